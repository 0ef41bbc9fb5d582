//! The set-up exchange: what each side of a pair publishes in the
//! communicator's store to connect its queue pair, and the checks the other
//! side makes before it trusts it.
//!
//! One line of text per direction, under `rdma/{from}-{to}`:
//!
//! ```text
//! ccl-rdma-v2 comm from to qpn lid gid psn mtu ring-addr ring-rkey slots slot-bytes gdr mac
//! ```
//!
//! `gdr` is 1 where this side can register GPU memory and may (GPUDirect
//! RDMA; a pair uses it only if both sides say 1), else 0. `mac` is
//! `HMAC-SHA256(job secret, "ccl-rdma-v2 " + everything before it)`
//! (`-` in a job without a secret). A reader refuses a line of another
//! communicator (a stale job's, left in a store that outlives jobs), of
//! another pair, with other ring sizes, or whose MAC does not prove the
//! secret (a stranger's): the ring address and key it carries let the peer
//! write into this process's memory, so they are only taken from a rank of
//! this job. A rank that cannot use RDMA publishes `none <reason>`, so that
//! the pair fails alike on both sides and falls to the next transport.

use ccl_core::JobSecret;
use ccl_rendezvous::auth;

use crate::{
    proto::RingConfig,
    verbs::{Endpoint, Remote},
};

const VERSION: &str = "ccl-rdma-v2";

/// What one side tells the other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    pub comm: u64,
    pub from: usize,
    pub to: usize,
    pub endpoint: Endpoint,
    /// This side's receive ring.
    pub ring: Remote,
    pub slots: usize,
    pub slot_bytes: usize,
    /// This side registers GPU memory (GPUDirect RDMA) and may use it.
    pub gpudirect: bool,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn mac(secret: Option<&JobSecret>, body: &str) -> String {
    match secret {
        Some(s) => hex(&auth::tag(s, body.as_bytes())),
        None => "-".into(),
    }
}

/// Constant-time comparison.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Offer {
    fn body(&self) -> String {
        let e = &self.endpoint;
        format!(
            "{VERSION} {:x} {} {} {} {} {} {} {} {:x} {} {} {} {}",
            self.comm,
            self.from,
            self.to,
            e.qpn,
            e.lid,
            hex(&e.gid),
            e.psn,
            e.mtu,
            self.ring.addr,
            self.ring.rkey,
            self.slots,
            self.slot_bytes,
            u8::from(self.gpudirect)
        )
    }

    /// The line to publish, with its MAC under `secret`.
    pub fn encode(&self, secret: Option<&JobSecret>) -> String {
        let body = self.body();
        let tag = mac(secret, &body);
        format!("{body} {tag}")
    }

    /// Parses and checks a line that rank `from` published for rank `to` of
    /// communicator `comm` with rings `cfg`: `Err` says why it is refused.
    pub fn accept(
        line: &[u8],
        secret: Option<&JobSecret>,
        (comm, from, to): (u64, usize, usize),
        cfg: &RingConfig,
    ) -> Result<Offer, String> {
        let text = std::str::from_utf8(line).map_err(|_| "set-up data is not text".to_string())?;
        if let Some(reason) = text.strip_prefix("none ") {
            return Err(format!("rank {from} cannot use RDMA: {reason}"));
        }
        let bad = || format!("malformed RDMA set-up data from rank {from}: {text:?}");
        let f: Vec<&str> = text.split(' ').collect();
        if f.len() != 15 || f[0] != VERSION {
            return Err(bad());
        }
        let num = |i: usize| f[i].parse::<u64>().map_err(|_| bad());
        let hexnum = |i: usize| u64::from_str_radix(f[i], 16).map_err(|_| bad());
        let gid: [u8; 16] = unhex(f[6])
            .and_then(|g| g.try_into().ok())
            .ok_or_else(bad)?;
        let offer = Offer {
            comm: hexnum(1)?,
            from: num(2)? as usize,
            to: num(3)? as usize,
            endpoint: Endpoint {
                qpn: num(4)? as u32,
                lid: num(5)? as u16,
                gid,
                psn: num(7)? as u32,
                mtu: num(8)? as u32,
            },
            ring: Remote {
                addr: hexnum(9)?,
                rkey: num(10)? as u32,
            },
            slots: num(11)? as usize,
            slot_bytes: num(12)? as usize,
            gpudirect: match f[13] {
                "0" => false,
                "1" => true,
                _ => return Err(bad()),
            },
        };
        let body = text.rsplit_once(' ').map(|(b, _)| b).ok_or_else(bad)?;
        let proven = match (secret, unhex(f[14])) {
            (None, _) => f[14] == "-",
            (Some(s), Some(got)) => same(&auth::tag(s, body.as_bytes()), &got),
            (Some(_), None) => false,
        };
        if !proven {
            return Err(format!(
                "RDMA set-up data for rank {to} from rank {from} does not prove this job's secret \
                 (a stranger's, or a job with another CCL_JOB_SECRET): refused"
            ));
        }
        if offer.comm != comm {
            return Err(format!(
                "RDMA set-up data from rank {from} belongs to communicator {:#x}, not {comm:#x} \
                 (a stale job's): refused",
                offer.comm
            ));
        }
        if (offer.from, offer.to) != (from, to) {
            return Err(format!(
                "RDMA set-up data under rank {from}'s key is for rank {} to rank {}: refused",
                offer.from, offer.to
            ));
        }
        if (offer.slots, offer.slot_bytes) != (cfg.slots, cfg.slot_bytes) {
            return Err(format!(
                "rank {from} has {} eager slots of {} bytes, this rank {} of {} \
                 (set CCL_RDMA_SLOTS and CCL_RDMA_SLOT_BYTES alike on every rank)",
                offer.slots, offer.slot_bytes, cfg.slots, cfg.slot_bytes
            ));
        }
        Ok(offer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        Offer {
            comm: 0xabc,
            from: 1,
            to: 0,
            endpoint: Endpoint {
                qpn: 77,
                lid: 3,
                gid: [7; 16],
                psn: 1234,
                mtu: 4096,
            },
            ring: Remote {
                addr: 0x7f00_1234_0000,
                rkey: 99,
            },
            slots: 16,
            slot_bytes: 65536,
            gpudirect: true,
        }
    }

    #[test]
    fn an_offer_of_this_job_is_accepted() {
        let secret = JobSecret::new("s3cret-s3cret-s3cret").unwrap();
        let cfg = RingConfig::default();
        let without_gpudirect = Offer {
            gpudirect: false,
            ..offer()
        };
        for s in [None, Some(&secret)] {
            for o in [offer(), without_gpudirect] {
                let line = o.encode(s);
                assert_eq!(
                    Offer::accept(line.as_bytes(), s, (0xabc, 1, 0), &cfg),
                    Ok(o)
                );
            }
        }
        // A line of the first version (no `gdr` field) is malformed now.
        let old = offer().encode(None).replace("ccl-rdma-v2", "ccl-rdma-v1");
        let old = old.replace(" 65536 1 -", " 65536 -");
        let e = Offer::accept(old.as_bytes(), None, (0xabc, 1, 0), &cfg);
        assert!(e.unwrap_err().contains("malformed"));
    }

    #[test]
    fn a_strangers_or_a_stale_jobs_offer_is_refused() {
        let secret = JobSecret::new("s3cret-s3cret-s3cret").unwrap();
        let other = JobSecret::new("another-secret-entirely").unwrap();
        let cfg = RingConfig::default();
        let ours = (0xabc, 1, 0);
        // A stranger: no MAC, or one made with another secret.
        let e = Offer::accept(offer().encode(None).as_bytes(), Some(&secret), ours, &cfg);
        assert!(e.unwrap_err().contains("does not prove this job's secret"));
        let e = Offer::accept(
            offer().encode(Some(&other)).as_bytes(),
            Some(&secret),
            ours,
            &cfg,
        );
        assert!(e.unwrap_err().contains("refused"));
        // A forged ring address under a valid-looking line.
        let forged = offer()
            .encode(Some(&secret))
            .replace("7f0012340000", "7f0012350000");
        let e = Offer::accept(forged.as_bytes(), Some(&secret), ours, &cfg);
        assert!(e.unwrap_err().contains("does not prove"));
        // A stale job: another communicator id.
        let stale = Offer {
            comm: 0xdef,
            ..offer()
        };
        let e = Offer::accept(
            stale.encode(Some(&secret)).as_bytes(),
            Some(&secret),
            ours,
            &cfg,
        );
        assert!(e.unwrap_err().contains("stale job"));
        // Another pair's data under this pair's key.
        let e = Offer::accept(offer().encode(None).as_bytes(), None, (0xabc, 2, 0), &cfg);
        assert!(e.unwrap_err().contains("is for rank 1 to rank 0"));
        // Other ring sizes.
        let small = RingConfig { slots: 4, ..cfg };
        let e = Offer::accept(offer().encode(None).as_bytes(), None, ours, &small);
        assert!(e.unwrap_err().contains("CCL_RDMA_SLOTS"));
        // Garbage, and a rank without RDMA.
        for junk in [&b"ccl-rdma-v2 1 2"[..], b"\xff\xfe", b""] {
            assert!(Offer::accept(junk, None, ours, &cfg).is_err());
        }
        let e = Offer::accept(b"none no RDMA device", None, ours, &cfg);
        assert_eq!(e.unwrap_err(), "rank 1 cannot use RDMA: no RDMA device");
    }
}
