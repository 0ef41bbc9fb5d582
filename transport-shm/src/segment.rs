//! A shared-memory segment: a file in a tmpfs (`/dev/shm`), mapped by two
//! processes and unlinked as soon as both have mapped it.

use std::{
    ffi::c_void,
    fs::{File, OpenOptions},
    io,
    num::NonZeroUsize,
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// A mapped segment. Unmapped on drop; the file is unlinked by whoever calls
/// [`Segment::unlink`] (both sides do; the second finds it gone).
pub(crate) struct Segment {
    ptr: NonNull<c_void>,
    len: usize,
    path: PathBuf,
}

// SAFETY: the mapping is plain shared memory; every access goes through
// atomics or through byte ranges that the ring protocol hands to one side at a time.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates a new file of `len` bytes under `dir` (which must not exist yet)
    /// with every page allocated, so that a full tmpfs is an error here rather
    /// than a SIGBUS later, and maps it.
    pub(crate) fn create(dir: &Path, name: &str, len: usize) -> io::Result<Segment> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let mapped = nix::fcntl::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t)
            .map_err(io::Error::from)
            .and_then(|()| Segment::map(&file, len, path.clone()));
        if mapped.is_err() {
            let _ = std::fs::remove_file(&path);
        }
        mapped
    }

    /// Maps an existing segment of `len` bytes.
    pub(crate) fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} has {actual} bytes, expected {len}", path.display()),
            ));
        }
        Segment::map(&file, len, path.to_path_buf())
    }

    fn map(file: &File, len: usize, path: PathBuf) -> io::Result<Segment> {
        let size = NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty segment"))?;
        // SAFETY: a fresh shared mapping of a file we own; nothing else in this
        // process refers to that address range.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                file,
                0,
            )
        }?;
        Ok(Segment { ptr, len, path })
    }

    /// Removes the file; the mappings stay valid. A file already gone is fine.
    pub(crate) fn unlink(&self) {
        match std::fs::remove_file(&self.path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                tracing::warn!("removing {}: {e}", self.path.display())
            }
            _ => {}
        }
    }

    /// The path the segment was created at.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Address of the mapping in this process.
    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    /// The 64-bit word at byte offset `off` (8-byte aligned, inside the segment).
    pub(crate) fn word(&self, off: usize) -> &AtomicU64 {
        assert!(
            off % 8 == 0 && off + 8 <= self.len,
            "word {off} outside segment"
        );
        // SAFETY: in bounds and aligned (the mapping is page-aligned); shared
        // words are only ever accessed atomically.
        unsafe { &*self.base().add(off).cast::<AtomicU64>() }
    }

    /// Reads word `off` (acquire).
    pub(crate) fn load(&self, off: usize) -> u64 {
        self.word(off).load(Ordering::Acquire)
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map`, unmapped only here.
        if let Err(e) = unsafe { munmap(self.ptr, self.len) } {
            tracing::warn!("unmapping {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_share_unlink() {
        let dir = std::env::temp_dir();
        let name = format!("ccl-segment-test-{}", std::process::id());
        let a = Segment::create(&dir, &name, 8192).unwrap();
        let b = Segment::open(&dir.join(&name), 8192).unwrap();
        a.word(64).store(42, Ordering::Release);
        assert_eq!(b.load(64), 42);
        assert!(
            Segment::create(&dir, &name, 8192).is_err(),
            "names are exclusive"
        );
        assert!(
            Segment::open(&dir.join(&name), 4096).is_err(),
            "size is checked"
        );
        b.unlink();
        a.unlink();
        assert!(!dir.join(&name).exists());
        assert_eq!(a.load(64), 42, "mapping outlives the file");
    }
}
