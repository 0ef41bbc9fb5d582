//! BBR with its window held to twice the measured bandwidth-delay product.
//!
//! quinn's BBR (a port of Chromium's BBRv1) let its window grow far past the
//! path: 4 hosts at 1 Gbit/s with 20 ms of delay each way (a 5 MB
//! bandwidth-delay product) saw windows of 20 to 74 MB and lost a third of
//! the packets it sent to the rate limiter's queue, with no random loss at
//! all. quinn paces at a rate derived from the window, not from BBR's
//! bandwidth estimate, so an oversized window also means sending too fast.
//! This wrapper measures the delivery rate itself (bytes acknowledged over
//! two minimum round trips, in intervals in which the sender was not
//! application-limited) and caps BBR's window at twice the highest of the
//! last [`SAMPLES`] rates times the minimum round trip, as BBR's own rule
//! says it should be. Both take the round trip as at least [`RTT_FLOOR`]:
//! between namespaces of one machine, at 1 Gbit/s with no delay, the
//! minimum round trip is some 25 µs, and intervals of twice that measured
//! bursts of acknowledgements, at three to four times the line's rate; the
//! window grew to 4.4 MB where the path holds 3 KB, filled the rate
//! limiter's queue (47 ms of round trip) and lost 12% of the packets.
//! The cap never goes below the initial window nor below
//! [`MIN_DATAGRAMS`] full-size datagrams.

use std::{
    any::Any,
    sync::Arc,
    time::{Duration, Instant},
};

use quinn::congestion::{BbrConfig, Controller, ControllerFactory, ControllerMetrics};
use quinn_proto::RttEstimator;

/// Delivery-rate samples the cap takes the highest of.
const SAMPLES: usize = 10;
/// A rate sample spans at least this many minimum round trips.
const INTERVAL_RTTS: u64 = 2;
/// The round trip the cap assumes at least. Where the path's own is far
/// shorter (loopback: tens of microseconds), the time a busy 2-core machine
/// takes to get to the packets dominates, and a cap from the path's round
/// trip halved QUIC's loopback throughput (0.70 GB/s against 1.33).
const RTT_FLOOR: Duration = Duration::from_millis(5);
/// The window may hold this many bandwidth-delay products.
const GAIN: u64 = 2;
/// The cap never holds the window below this many full-size datagrams.
/// Fewer can be fewer than a receiver that acknowledges every few packets
/// waits for: it then answers only after its acknowledgement delay, the
/// rate measured falls to a window per delay, and the cap with it. On
/// loopback (65 527-byte datagrams, where quinn's initial window is under 4
/// of them) a 256 MiB allreduce crawled so (12 iterations unfinished after
/// 60 s) when receivers acknowledged every 4th packet.
const MIN_DATAGRAMS: u64 = 16;

/// Builds [`CappedBbr`] controllers around quinn's BBR.
pub(crate) struct CappedBbrConfig(pub(crate) Arc<BbrConfig>);

impl ControllerFactory for CappedBbrConfig {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(CappedBbr {
            inner: Arc::clone(&self.0).build(now, current_mtu),
            rate: DeliveryRate::default(),
            mtu: u64::from(current_mtu),
        })
    }
}

/// quinn's BBR with its window capped (see the module docs).
struct CappedBbr {
    inner: Box<dyn Controller>,
    rate: DeliveryRate,
    /// The largest datagram the path carries now.
    mtu: u64,
}

/// Bytes acknowledged per minimum round trip: the last [`SAMPLES`] rates.
#[derive(Clone, Default)]
struct DeliveryRate {
    /// Start of the interval being measured and bytes acknowledged in it.
    interval: Option<(Instant, u64)>,
    /// Rates in bytes per second, newest at `next - 1` (mod [`SAMPLES`]).
    rates: [u64; SAMPLES],
    next: usize,
    /// The smallest round trip seen, in nanoseconds.
    min_rtt_ns: u64,
}

impl DeliveryRate {
    fn on_ack(&mut self, now: Instant, bytes: u64, app_limited: bool, min_rtt_ns: u64) {
        self.min_rtt_ns = min_rtt_ns;
        let rtt_ns = self.rtt_ns();
        if app_limited || min_rtt_ns == 0 {
            // An idle sender says nothing about the path's rate.
            self.interval = None;
            return;
        }
        // The interval starts at an acknowledgement and counts the bytes
        // acknowledged after it, over at least two round trips (of at least
        // RTT_FLOOR), so that a burst of acknowledgements does not read as a
        // faster path.
        let Some((start, acked)) = &mut self.interval else {
            self.interval = Some((now, 0));
            return;
        };
        *acked += bytes;
        let elapsed = now.saturating_duration_since(*start).as_nanos() as u64;
        if elapsed >= INTERVAL_RTTS * rtt_ns {
            let rate = (*acked as u128 * 1_000_000_000 / elapsed as u128) as u64;
            self.rates[self.next] = rate;
            self.next = (self.next + 1) % SAMPLES;
            self.interval = None;
        }
    }

    /// The round trip both the interval and the cap use: the smallest seen,
    /// at least [`RTT_FLOOR`].
    fn rtt_ns(&self) -> u64 {
        self.min_rtt_ns.max(RTT_FLOOR.as_nanos() as u64)
    }

    /// Twice the bandwidth-delay product, once a rate was measured.
    fn cap(&self) -> Option<u64> {
        let best = *self.rates.iter().max()?;
        if best == 0 {
            return None;
        }
        let bdp = (best as u128 * self.rtt_ns() as u128 / 1_000_000_000) as u64;
        Some(GAIN * bdp)
    }
}

/// BBR's `window` held to `cap`, but never below the connection's `initial`
/// window nor below [`MIN_DATAGRAMS`] datagrams of `mtu` bytes.
fn capped(window: u64, cap: Option<u64>, initial: u64, mtu: u64) -> u64 {
    match cap {
        Some(cap) => window.min(cap.max(initial).max(MIN_DATAGRAMS * mtu)),
        None => window,
    }
}

impl Controller for CappedBbr {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        self.rate
            .on_ack(now, bytes, app_limited, rtt.min().as_nanos() as u64);
        self.inner.on_ack(now, sent, bytes, app_limited, rtt);
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        self.inner
            .on_end_acks(now, in_flight, app_limited, largest_packet_num_acked);
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = u64::from(new_mtu);
        self.inner.on_mtu_update(new_mtu);
    }

    fn window(&self) -> u64 {
        capped(
            self.inner.window(),
            self.rate.cap(),
            self.inner.initial_window(),
            self.mtu,
        )
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = self.inner.metrics();
        m.congestion_window = self.window();
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(CappedBbr {
            inner: self.inner.clone_box(),
            rate: self.rate.clone(),
            mtu: self.mtu,
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window()
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_is_twice_the_best_rate_times_the_minimum_round_trip() {
        let mut r = DeliveryRate::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let rtt = ms(40).as_nanos() as u64;
        // One interval: starts at an acknowledgement (its bytes not counted),
        // ends two round trips later.
        let interval = |r: &mut DeliveryRate, start: Instant, bytes: u64, limited: bool| {
            r.on_ack(start, 1_000_000, limited, rtt);
            r.on_ack(start + ms(40), bytes / 2, limited, rtt);
            r.on_ack(start + ms(80), bytes - bytes / 2, limited, rtt);
        };
        assert_eq!(r.cap(), None, "no cap before a rate is measured");
        // 10 MB acknowledged over two 40 ms round trips: 125 MB/s.
        interval(&mut r, t0, 10_000_000, false);
        assert_eq!(r.cap(), Some(10_000_000));
        // A slower interval does not lower the cap: the best of the last ones counts.
        interval(&mut r, t0 + ms(100), 2_000_000, false);
        assert_eq!(r.cap(), Some(10_000_000));
        // Application-limited intervals are not samples.
        interval(&mut r, t0 + ms(200), 100_000_000, true);
        assert_eq!(r.cap(), Some(10_000_000));
        // Once SAMPLES slower intervals have passed, the old best is gone.
        for i in 0..SAMPLES as u32 {
            interval(&mut r, t0 + ms(300) + ms(100) * i, 5_000_000, false);
        }
        assert_eq!(r.cap(), Some(5_000_000));
    }

    #[test]
    fn the_cap_leaves_room_for_min_datagrams_full_size_datagrams() {
        let (initial, big, small) = (240_000, 65_527, 1_452);
        // A low cap on loopback-sized datagrams: 16 of them still fit.
        assert_eq!(capped(50_000_000, Some(100_000), initial, big), 16 * big);
        // On 1 452-byte datagrams the initial window is the higher floor.
        assert_eq!(capped(50_000_000, Some(100_000), initial, small), initial);
        // A cap above the floors holds; BBR's own smaller window holds too.
        assert_eq!(capped(50_000_000, Some(5_000_000), initial, big), 5_000_000);
        assert_eq!(capped(500_000, Some(100_000), initial, big), 500_000);
        // No cap before a rate was measured.
        assert_eq!(capped(50_000_000, None, initial, big), 50_000_000);
    }

    #[test]
    fn a_burst_of_acknowledgements_on_a_short_path_is_not_a_rate() {
        let mut r = DeliveryRate::default();
        let t0 = Instant::now();
        let us = Duration::from_micros;
        let rtt = us(25).as_nanos() as u64;
        // 64 KB acknowledged within 50 µs (two of the path's round trips):
        // 1.3 GB/s, were it a rate.
        r.on_ack(t0, 1_000, false, rtt);
        r.on_ack(t0 + us(50), 64_000, false, rtt);
        assert_eq!(
            r.cap(),
            None,
            "a burst shorter than two RTT_FLOORs is no sample"
        );
        // The same path delivering 125 MB/s over 10 ms: 1.25 MB acknowledged.
        r.on_ack(t0 + us(10_000), 1_186_000, false, rtt);
        // Twice 125 MB/s times the floor's 5 ms.
        assert_eq!(r.cap(), Some(1_250_000));
    }
}
