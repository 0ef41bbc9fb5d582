//! Sizes as people type them (`256MB`, `8B`, `1.5GiB`) and the sweeps built from them.
//!
//! K, M, G and T are binary (2^10, 2^20, 2^30, 2^40) however they are written:
//! `256MB`, `256M`, `256MiB` and `256mb` all mean 256 × 2^20 bytes, as in
//! nccl-tests (`-b 256M`). A bare number is bytes.

/// The largest size accepted (1 TiB): more is a typo, not a benchmark.
pub const MAX_BYTES: u64 = 1 << 40;

/// The most sizes one sweep may have.
pub const MAX_SWEEP_SIZES: usize = 4096;

/// Parses a size: a positive number (fractions allowed) and an optional unit.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err("empty size (expected e.g. 8B, 64KB, 256MB, 1GiB)".into());
    }
    if t.starts_with('-') {
        return Err(format!("size '{s}' is negative"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let value: f64 = num
        .parse()
        .ok()
        .filter(|v: &f64| v.is_finite())
        .ok_or_else(|| format!("malformed size '{s}' (expected e.g. 8B, 64KB, 256MB, 1GiB)"))?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        _ => {
            return Err(format!(
            "malformed size '{s}': unknown unit '{unit}' (expected B, KB, MB, GB, KiB, MiB, GiB)"
        ))
        }
    };
    let bytes = value * mult as f64;
    if bytes > MAX_BYTES as f64 {
        return Err(format!("size '{s}' is larger than 1 TiB"));
    }
    let bytes = bytes.floor() as u64;
    if bytes == 0 {
        return Err(format!(
            "size '{s}' is zero (sizes must be at least 1 byte)"
        ));
    }
    Ok(bytes)
}

/// `bytes` in the largest power-of-1024 unit that keeps the value at least 1,
/// with that unit's index (0 = bytes, 1 = Ki, ...).
fn scaled(bytes: u64) -> (f64, usize) {
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < 5 {
        v /= 1024.0;
        u += 1;
    }
    (v, u)
}

/// `1536` → `1.5 KiB`; `268435456` → `256 MiB`; `8` → `8 B`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let (v, u) = scaled(bytes);
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        let s = format!("{v:.2}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        format!("{s} {}", UNITS[u])
    }
}

/// Short axis label: `8B`, `4K`, `1M`, `2G`.
pub fn short_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let (v, u) = scaled(bytes);
    if v.fract() == 0.0 {
        format!("{v:.0}{}", UNITS[u])
    } else {
        format!("{v:.1}{}", UNITS[u])
    }
}

/// The sizes of a sweep from `min` to `max` (both included when reached),
/// each `factor` times the previous one (at least one byte more).
pub fn sweep(min: u64, max: u64, factor: f64) -> Result<Vec<u64>, String> {
    if min > max {
        return Err(format!(
            "--min-size {} is larger than --max-size {}",
            format_size(min),
            format_size(max)
        ));
    }
    if !(factor.is_finite() && factor > 1.0) {
        return Err(format!("--factor {factor} must be a number above 1"));
    }
    let mut sizes = Vec::new();
    let mut s = min;
    while s <= max {
        if sizes.len() == MAX_SWEEP_SIZES {
            return Err(format!(
                "the sweep from {} to {} by {factor} has more than {MAX_SWEEP_SIZES} sizes",
                format_size(min),
                format_size(max)
            ));
        }
        sizes.push(s);
        let next = (s as f64 * factor).floor();
        s = if next >= u64::MAX as f64 {
            u64::MAX
        } else {
            (next as u64).max(s + 1)
        };
        if s == u64::MAX {
            break;
        }
    }
    Ok(sizes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_binary() {
        assert_eq!(parse_size("256MB").unwrap(), 256 << 20);
        assert_eq!(parse_size("256MiB").unwrap(), 256 << 20);
        assert_eq!(parse_size("256m").unwrap(), 256 << 20);
        assert_eq!(parse_size("8B").unwrap(), 8);
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("1KB").unwrap(), 1024);
        assert_eq!(parse_size("1 KiB").unwrap(), 1024);
        assert_eq!(parse_size("1.5GB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2gib").unwrap(), 2 << 30);
    }

    #[test]
    fn bad_sizes() {
        for bad in [
            "", "12XB", "-5MB", "0", "0MB", "MB", "1..5MB", "2TB", "nan", "0.1B",
        ] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn formatting() {
        assert_eq!(format_size(8), "8 B");
        assert_eq!(format_size(256 << 20), "256 MiB");
        assert_eq!(format_size(1536), "1.5 KiB");
        assert_eq!(short_size(4096), "4K");
        assert_eq!(short_size(1 << 30), "1G");
    }

    #[test]
    fn sweeps() {
        assert_eq!(sweep(8, 64, 2.0).unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(sweep(8, 100, 4.0).unwrap(), vec![8, 32]);
        assert_eq!(sweep(1, 3, 1.1).unwrap(), vec![1, 2, 3]);
        assert_eq!(sweep(5, 5, 2.0).unwrap(), vec![5]);
        assert!(sweep(64, 8, 2.0).is_err());
        assert!(sweep(8, 64, 1.0).is_err());
        assert!(sweep(1, 1 << 40, 1.0001).is_err());
    }
}
