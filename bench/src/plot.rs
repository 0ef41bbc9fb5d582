//! `--plot FILE.png`: bus bandwidth against message size (log2 axis), one line per series.
//!
//! Text is drawn with DejaVu Sans compiled into the binary (the `dejavu`
//! crate), so plots need no system font; any failure to draw is an error,
//! never a half-drawn image.

use std::{path::Path, sync::OnceLock};

use std::ops::Range;

use plotters::{
    coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged},
    prelude::*,
    style::FontStyle,
};

use crate::size::short_size;

/// One line of the plot.
pub struct Series {
    pub label: String,
    /// (size in bytes, busbw in GB/s)
    pub points: Vec<(u64, f64)>,
}

const FONT: &str = "sans-serif";

fn register_fonts() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for (style, bytes) in [
            (FontStyle::Normal, dejavu::sans::regular()),
            (FontStyle::Bold, dejavu::sans::bold()),
        ] {
            plotters::style::register_font(FONT, style, bytes)
                .map_err(|_| "the bundled DejaVu Sans font could not be loaded".to_string())?;
        }
        Ok(())
    })
    .clone()
}

/// Draws `series` into `path` (PNG).
pub fn plot_busbw(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    register_fonts()?;
    draw(path, title, series).map_err(|e| format!("cannot draw {}: {e}", path.display()))
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

fn draw(path: &Path, title: &str, series: &[Series]) -> Result<(), Box<dyn std::error::Error>> {
    let points = series.iter().flat_map(|s| s.points.iter());
    let (mut lo, mut hi, mut ymax) = (f64::MAX, f64::MIN, 0f64);
    for &(size, bw) in points {
        let x = (size.max(1) as f64).log2();
        lo = lo.min(x);
        hi = hi.max(x);
        ymax = ymax.max(bw);
    }
    if lo > hi {
        (lo, hi) = (0.0, 10.0);
    }
    let (lo, hi) = (lo.floor() - 0.5, hi.ceil() + 0.5);
    let ymax = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };

    let root = BitMapBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(75)
        .build_cartesian_2d(Log2Axis { lo, hi }, 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc("message size (bytes, log scale)")
        .y_desc("bus bandwidth (GB/s)")
        .x_label_formatter(&|x| short_size(x.exp2().round() as u64))
        .y_label_formatter(&|y| format!("{y:.2}"))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .light_line_style(RGBColor(238, 238, 238))
        .max_light_lines(3)
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(size, bw)| ((size.max(1) as f64).log2(), bw))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(s.label.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
            });
        chart.draw_series(
            pts.into_iter()
                .map(move |p| Circle::new(p, 4, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, 16))
        .draw()?;
    root.present()?;
    Ok(())
}

/// The x axis: log2 of the size, labelled at powers of two only.
struct Log2Axis {
    lo: f64,
    hi: f64,
}

impl Ranged for Log2Axis {
    type ValueType = f64;
    type FormatOption = DefaultFormatting;

    fn map(&self, v: &f64, pixels: (i32, i32)) -> i32 {
        let t = (v - self.lo) / (self.hi - self.lo);
        pixels.0 + (f64::from(pixels.1 - pixels.0) * t).round() as i32
    }

    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        let (first, last) = (self.lo.ceil() as i64, self.hi.floor() as i64);
        let count = (last - first + 1).max(0) as usize;
        let max = hint.max_num_points().clamp(1, 16);
        let step = count.div_ceil(max).max(1);
        (first..=last).step_by(step).map(|k| k as f64).collect()
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}
