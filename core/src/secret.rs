//! The job secret (`CCL_JOB_SECRET`): what every connection of a job proves
//! (the protocol lives in `ccl-rendezvous`'s `auth`).

use std::{fmt, sync::Arc};

use crate::{Error, Result};

/// Longest secret accepted, in bytes.
pub const MAX_SECRET: usize = 4096;

/// The shared secret of a job. Its bytes never appear in `Debug` output or
/// error messages.
#[derive(Clone)]
pub struct JobSecret(Arc<[u8]>);

impl JobSecret {
    /// A secret of these bytes; an error if empty or longer than [`MAX_SECRET`].
    pub fn new(bytes: impl AsRef<[u8]>) -> Result<JobSecret> {
        let b = bytes.as_ref();
        if b.is_empty() || b.len() > MAX_SECRET {
            return Err(Error::Config(format!(
                "CCL_JOB_SECRET of {} bytes: it must hold 1 to {MAX_SECRET} bytes",
                b.len()
            )));
        }
        Ok(JobSecret(b.into()))
    }

    /// The secret's bytes, for keying a MAC. Never print or send them.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for JobSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobSecret(<{} bytes, redacted>)", self.0.len())
    }
}

impl PartialEq for JobSecret {
    /// Constant time in the contents (for secrets of equal length).
    fn eq(&self, other: &JobSecret) -> bool {
        self.0.len() == other.0.len()
            && self
                .0
                .iter()
                .zip(other.0.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl Eq for JobSecret {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_and_redaction() {
        assert!(JobSecret::new("").is_err());
        assert!(JobSecret::new(vec![1u8; MAX_SECRET + 1]).is_err());
        let s = JobSecret::new("s3cret").unwrap();
        assert_eq!(s, JobSecret::new("s3cret").unwrap());
        assert_ne!(s, JobSecret::new("s3creT").unwrap());
        assert!(!format!("{s:?}").contains("s3cret"));
    }
}
