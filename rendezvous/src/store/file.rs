//! A store kept as files in one directory, e.g. on a shared filesystem that
//! every rank mounts (`CCL_STORE_PATH`).
//!
//! Each key is one file whose contents are the value. File names encode the
//! key (see [`file_name`]), so any key is safe: `/`, `..` and NUL in keys are
//! just bytes. `set` writes a temporary file and renames it over the key's
//! file, so readers see the old or the new value, never a mix. Every change
//! (`set`, `add`, `compare_set`, `delete`) holds an exclusive `flock` on the
//! directory's lock file, so read-modify-writes are atomic across threads and
//! processes. `wait` polls.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
    thread,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use nix::{
    errno::Errno,
    fcntl::{Flock, FlockArg},
};

use super::{hash::parse_counter, Store};
use ccl_core::{Error, Result};

/// Name of the lock file in the store's directory.
const LOCK_FILE: &str = ".lock";
/// Prefix of temporary files (never the prefix of a key's file).
const TMP_PREFIX: &str = ".tmp-";
/// Encoded keys longer than this are stored under a hash.
const MAX_NAME: usize = 200;
/// First and longest pause between polls of `wait`.
const FIRST_POLL: Duration = Duration::from_millis(1);
const MAX_POLL: Duration = Duration::from_millis(20);

/// The key that counts the processes using a [`FileStore::for_job`] directory.
const USERS_KEY: &str = "ccl-job-dir-users";

/// The [`FileStore::for_job`] directories this process counts itself in;
/// it leaves them when it exits.
static JOINED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A store kept as files in a directory.
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
}

/// 128-bit FNV-1a, stable across processes, builds and machines.
fn fnv1a_128(bytes: &[u8]) -> u128 {
    const OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
    const PRIME: u128 = 0x0000000001000000000000000000013b;
    bytes
        .iter()
        .fold(OFFSET, |h, &b| (h ^ b as u128).wrapping_mul(PRIME))
}

/// The file name of `key`: `k_` then the key with every byte but `a-z`,
/// `0-9`, `_` and `-` written `%XX` (upper-case hex, so names stay distinct
/// on case-insensitive filesystems too). Keys whose name would be long are
/// `h_`, the start of that, and a 128-bit hash of the key.
fn file_name(key: &str) -> String {
    let mut enc = String::with_capacity(key.len() + 2);
    enc.push_str("k_");
    for &b in key.as_bytes() {
        if b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-' {
            enc.push(b as char);
        } else {
            enc.push_str(&format!("%{b:02X}"));
        }
    }
    if enc.len() <= MAX_NAME {
        return enc;
    }
    // The encoding is ASCII, so any byte index is a char boundary.
    format!(
        "h_{}_{:032x}",
        &enc[2..MAX_NAME / 2],
        fnv1a_128(key.as_bytes())
    )
}

impl FileStore {
    /// A store kept as files in directory `dir` (created if missing), e.g.
    /// on a shared filesystem.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let store = FileStore { dir: dir.into() };
        fs::create_dir_all(&store.dir).map_err(|e| store.error("creating the directory", e))?;
        if !store.dir.is_dir() {
            return Err(Error::Store {
                addr: store.describe(),
                msg: "not a directory".into(),
            });
        }
        Ok(store)
    }

    /// A store in a directory of one job's own (created if missing), which
    /// the last of the processes that opened it removes when it exits: for
    /// the ranks of one host, meeting in the temp dir. The count is kept at
    /// exit (`atexit`), not when the store is dropped, since a communicator's
    /// threads may hold the store until the process ends. A process killed
    /// by a signal leaves the directory behind.
    pub fn for_job(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let store = FileStore::new(dir)?;
        let mut joined = JOINED.lock().unwrap_or_else(|p| p.into_inner());
        if !joined.contains(&store.dir) {
            store.add(USERS_KEY, 1)?;
            if joined.is_empty() {
                static AT_EXIT: std::sync::Once = std::sync::Once::new();
                // SAFETY: registers a function that takes nothing and
                // returns nothing, as atexit expects.
                AT_EXIT.call_once(|| unsafe {
                    libc::atexit(leave_job_dirs);
                });
            }
            joined.push(store.dir.clone());
        }
        Ok(store)
    }

    /// Counts this process out of a [`FileStore::for_job`] directory, and
    /// removes the directory if it was the last.
    fn leave(&self) -> Result<()> {
        let _lock = self.lock()?;
        let users = match self.read(USERS_KEY)? {
            Some(v) => parse_counter(USERS_KEY, &v)?,
            None => 0,
        } - 1;
        if users > 0 {
            return self.write(USERS_KEY, users.to_string().as_bytes());
        }
        fs::remove_dir_all(&self.dir).map_err(|e| self.error("removing the job's directory", e))
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(file_name(key))
    }

    fn error(&self, doing: &str, e: io::Error) -> Error {
        Error::Store {
            addr: self.describe(),
            msg: format!("{doing}: {e}"),
        }
    }

    /// Holds the store's exclusive lock until dropped.
    fn lock(&self) -> Result<Flock<File>> {
        let path = self.dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| self.error("opening the lock file", e))?;
        loop {
            match Flock::lock(file, FlockArg::LockExclusive) {
                Ok(locked) => return Ok(locked),
                Err((f, Errno::EINTR)) => file = f,
                Err((_, errno)) => return Err(self.error("locking", errno.into())),
            }
        }
    }

    fn read(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match fs::read(self.path(key)) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.error(&format!("reading key '{key}'"), e)),
        }
    }

    fn exists(&self, key: &str) -> Result<bool> {
        match fs::metadata(self.path(key)) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.error(&format!("looking up key '{key}'"), e)),
        }
    }

    /// Replaces `key`'s file atomically. Callers hold the lock.
    fn write(&self, key: &str, value: &[u8]) -> Result<()> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let doing = || format!("writing key '{key}'");
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let (tmp, mut file) = loop {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let tmp = self
                .dir
                .join(format!("{TMP_PREFIX}{}-{n}-{nanos}", std::process::id()));
            // A stale name from a crashed process: take the next.
            match OpenOptions::new().write(true).create_new(true).open(&tmp) {
                Ok(f) => break (tmp, f),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(self.error(&doing(), e)),
            }
        };
        let written = file.write_all(value).and_then(|()| {
            drop(file);
            fs::rename(&tmp, self.path(key))
        });
        written.map_err(|e| {
            let _ = fs::remove_file(&tmp);
            self.error(&doing(), e)
        })
    }

    /// The directory the store lives in.
    fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Leaves every job directory this process joined (run at exit).
extern "C" fn leave_job_dirs() {
    let dirs = std::mem::take(&mut *JOINED.lock().unwrap_or_else(|p| p.into_inner()));
    for dir in dirs {
        if let Err(e) = (FileStore { dir }).leave() {
            tracing::warn!("{e}");
        }
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let _lock = self.lock()?;
        self.write(key, value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.read(key)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let deadline = Instant::now().checked_add(timeout);
        let mut pause = FIRST_POLL;
        let mut missing: Vec<&str> = keys.to_vec();
        loop {
            let mut still = Vec::new();
            for &k in &missing {
                if !self.exists(k)? {
                    still.push(k);
                }
            }
            missing = still;
            if missing.is_empty() {
                return Ok(());
            }
            let left = deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            });
            if left.is_zero() {
                return Err(Error::Timeout {
                    context: self.describe(),
                    what: format!("keys {missing:?}"),
                    after: timeout,
                });
            }
            thread::sleep(pause.min(left));
            pause = (pause * 2).min(MAX_POLL);
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let _lock = self.lock()?;
        let now = match self.read(key)? {
            Some(v) => parse_counter(key, &v)?,
            None => 0,
        }
        .wrapping_add(delta);
        self.write(key, now.to_string().as_bytes())?;
        Ok(now)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>> {
        let _lock = self.lock()?;
        let current = self.read(key)?;
        if current.as_deref() == expected {
            self.write(key, desired)?;
            return Ok(desired.to_vec());
        }
        Ok(current.unwrap_or_default())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let _lock = self.lock()?;
        match fs::remove_file(self.path(key)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.error(&format!("deleting key '{key}'"), e)),
        }
    }

    fn describe(&self) -> String {
        format!("file://{}", self.dir().display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{process::Command, sync::Arc};

    const T: Duration = Duration::from_secs(5);

    #[test]
    fn semantics() {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(FileStore::new(dir.path().join("new/sub")).unwrap());
        super::super::conformance(&*s);
        assert!(s.describe().starts_with("file://"));
        let s2 = s.clone();
        let t = thread::spawn(move || s2.wait(&["late"], T));
        thread::sleep(Duration::from_millis(10));
        s.set("late", b"").unwrap();
        t.join().unwrap().unwrap();
    }

    #[test]
    fn odd_keys_stay_inside_and_apart() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::new(dir.path().join("store")).unwrap();
        let long_a = format!("{}a", "x".repeat(1000));
        let long_b = format!("{}b", "x".repeat(1000));
        let keys = [
            "",
            ".",
            "..",
            "../escape",
            "/abs",
            "a/b",
            "A",
            "a",
            "%41",
            "k_a",
            ".lock",
            ".tmp-1",
            "ключ",
            "nul\0",
            &long_a,
            &long_b,
        ];
        for (i, k) in keys.iter().enumerate() {
            s.set(k, i.to_string().as_bytes()).unwrap();
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(
                s.try_get(k).unwrap().unwrap(),
                i.to_string().as_bytes(),
                "key {k:?}"
            );
        }
        // Nothing was written outside the store's directory.
        let outside: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(outside, ["store"]);
        // One file per key, plus the lock file; no temporary files left.
        assert_eq!(fs::read_dir(s.dir()).unwrap().count(), keys.len() + 1);
    }

    #[test]
    fn concurrent_adds_across_instances() {
        let dir = tempfile::tempdir().unwrap();
        let threads: Vec<_> = (0..16)
            .map(|i| {
                let path = dir.path().to_path_buf();
                thread::spawn(move || {
                    let s = FileStore::new(path).unwrap();
                    for r in 0..20 {
                        s.add("counter", i + r).unwrap();
                        s.set(&format!("k{i}"), b"").unwrap();
                        assert_eq!(
                            s.compare_set("once", None, &i.to_be_bytes()).unwrap().len(),
                            8
                        );
                    }
                    s.wait(
                        &(0..16)
                            .map(|j| format!("k{j}"))
                            .collect::<Vec<_>>()
                            .iter()
                            .map(String::as_str)
                            .collect::<Vec<_>>(),
                        T,
                    )
                    .unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = FileStore::new(dir.path()).unwrap();
        let want: i64 = (0..16).map(|i| (0..20).map(|r| i + r).sum::<i64>()).sum();
        assert_eq!(s.add("counter", 0).unwrap(), want);
    }

    #[test]
    fn wait_timeout_is_prompt() {
        let dir = tempfile::tempdir().unwrap();
        let s = FileStore::new(dir.path()).unwrap();
        let start = Instant::now();
        assert!(matches!(
            s.wait(&["never"], Duration::from_millis(100)),
            Err(Error::Timeout { .. })
        ));
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
    }

    const JOB_CHILD_ENV: &str = "CCL_FILE_STORE_TEST_JOB_DIR";

    /// Run by `the_last_process_to_exit_removes_a_job_directory` in child
    /// processes: joins the job directory, counts itself in, waits until
    /// `CCL_FILE_STORE_TEST_JOB_SIZE` processes did and for the key `exit`,
    /// then exits; a no-op otherwise.
    #[test]
    fn job_dir_child() {
        let Ok(dir) = std::env::var(JOB_CHILD_ENV) else {
            return;
        };
        let size: i64 = std::env::var("CCL_FILE_STORE_TEST_JOB_SIZE")
            .unwrap()
            .parse()
            .unwrap();
        let s = FileStore::for_job(&dir).unwrap();
        // Joining twice counts once.
        drop(FileStore::for_job(&dir).unwrap());
        let me = s.add("ranks", 1).unwrap();
        s.set(&format!("rank/{me}"), b"").unwrap();
        let all: Vec<String> = (1..=size).map(|r| format!("rank/{r}")).collect();
        s.wait(&all.iter().map(String::as_str).collect::<Vec<_>>(), T)
            .unwrap();
        s.wait(&["exit"], T).unwrap();
        // Held by another thread at exit, as a communicator's threads do.
        let held = Arc::new(s);
        thread::spawn(move || {
            let _held = held;
            thread::sleep(Duration::from_secs(60));
        });
    }

    fn job_dir_children(dir: &Path, n: usize) -> Vec<std::process::Child> {
        (0..n)
            .map(|_| {
                Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", "store::file::tests::job_dir_child", "-q"])
                    .env(JOB_CHILD_ENV, dir)
                    .env("CCL_FILE_STORE_TEST_JOB_SIZE", n.to_string())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn the_last_process_to_exit_removes_a_job_directory() {
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("ccl-openmpi-7");
        FileStore::new(&dir).unwrap().set("exit", b"").unwrap();
        for mut c in job_dir_children(&dir, 3) {
            assert!(c.wait().unwrap().success());
        }
        assert!(!dir.exists(), "{} is left", dir.display());
        // One process killed: the directory stays.
        let mut children = job_dir_children(&dir, 2);
        let deadline = Instant::now() + T;
        while FileStore::new(&dir)
            .unwrap()
            .try_get("rank/2")
            .unwrap()
            .is_none()
        {
            assert!(Instant::now() < deadline, "the children never met");
            thread::sleep(Duration::from_millis(5));
        }
        children[0].kill().unwrap();
        FileStore::new(&dir).unwrap().set("exit", b"").unwrap();
        for mut c in children {
            let _ = c.wait().unwrap();
        }
        let users = FileStore::new(&dir).unwrap().add(USERS_KEY, 0).unwrap();
        assert_eq!(users, 1);
    }

    const CHILD_ENV: &str = "CCL_FILE_STORE_TEST_CHILD_DIR";
    const CHILD_ADDS: i64 = 100;

    /// Run by `across_processes` in child processes; a no-op otherwise.
    #[test]
    fn child_process_adder() {
        let Ok(dir) = std::env::var(CHILD_ENV) else {
            return;
        };
        let s = FileStore::new(dir).unwrap();
        for _ in 0..CHILD_ADDS {
            s.add("counter", 1).unwrap();
        }
        s.set(&format!("done/{}", std::process::id()), b"").unwrap();
    }

    #[test]
    fn across_processes() {
        let dir = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<_> = (0..3)
            .map(|_| {
                Command::new(&exe)
                    .args([
                        "--exact",
                        "store::file::tests::child_process_adder",
                        "--test-threads=1",
                        "-q",
                    ])
                    .env(CHILD_ENV, dir.path())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let s = FileStore::new(dir.path()).unwrap();
        for _ in 0..CHILD_ADDS {
            s.add("counter", 1).unwrap();
        }
        let pids: Vec<String> = children
            .iter()
            .map(|c| format!("done/{}", c.id()))
            .collect();
        for mut c in children {
            assert!(c.wait().unwrap().success());
        }
        s.wait(&pids.iter().map(String::as_str).collect::<Vec<_>>(), T)
            .unwrap();
        assert_eq!(s.add("counter", 0).unwrap(), 4 * CHILD_ADDS);
    }
}
