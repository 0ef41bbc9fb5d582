//! Line tagging of the ranks' stdout/stderr.
//!
//! One thread per child pipe reads complete lines and writes them, prefixed
//! with `[rank R] `, to `ccl-run`'s own stdout or stderr. Each tagged line is
//! written with a single `write_all` while holding the stream's lock, so lines
//! from different ranks never interleave mid-line.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::mpsc::Sender;
use std::thread::{self, JoinHandle};

/// Which of `ccl-run`'s own streams a child pipe is forwarded to.
#[derive(Clone, Copy, Debug)]
pub enum Target {
    Stdout,
    Stderr,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Stdout => "stdout",
            Target::Stderr => "stderr",
        }
    }

    /// Writes one complete (newline-terminated) line atomically with respect
    /// to the other reader threads. Write errors (e.g. a closed stdout) are
    /// ignored so that the reader keeps draining the child's pipe and the
    /// child never blocks on a full pipe.
    fn write_line(self, line: &[u8]) {
        match self {
            Target::Stdout => {
                let mut out = io::stdout().lock();
                let _ = out.write_all(line);
                let _ = out.flush();
            }
            Target::Stderr => {
                let mut err = io::stderr().lock();
                let _ = err.write_all(line);
                let _ = err.flush();
            }
        }
    }
}

/// Starts a thread that forwards `src` line by line to `target`, each line
/// prefixed with `[rank R] `. A final line without a trailing newline is
/// still forwarded (with a newline added).
///
/// `done` is never sent on; it is dropped when the thread finishes, which
/// lets the caller wait (with a timeout) for all readers to reach EOF by
/// waiting for the channel to disconnect.
pub fn spawn_tagger<R>(
    src: R,
    rank: usize,
    target: Target,
    done: Sender<()>,
) -> io::Result<JoinHandle<()>>
where
    R: Read + Send + 'static,
{
    thread::Builder::new()
        .name(format!("rank{rank}-{}", target.name()))
        .spawn(move || {
            let _done = done;
            pump(src, format!("[rank {rank}] ").as_bytes(), target);
        })
}

/// Reads `src` until EOF (or a read error) and forwards tagged lines.
fn pump<R: Read>(src: R, prefix: &[u8], target: Target) {
    let mut reader = BufReader::new(src);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        line.extend_from_slice(prefix);
        // `read_until` retries on EINTR by itself.
        let result = reader.read_until(b'\n', &mut line);
        if line.len() > prefix.len() {
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            target.write_line(&line);
        }
        // Stop at EOF, or on a read error (after forwarding what was read).
        if !matches!(result, Ok(n) if n > 0) {
            return;
        }
    }
}
