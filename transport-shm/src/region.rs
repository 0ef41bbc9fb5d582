//! Shared buffers: host memory that ccl allocates in a memory file
//! (`memfd_create`), so that the other ranks of its host can map it and
//! copy it with the CPU's own loads and stores. Cross-memory attach, which
//! serves every other buffer, has the kernel pin each page before it
//! copies it: on a 2-core VM it moved 64 MiB at about 5 GB/s, where a copy
//! between mapped memory ran at 10 GB/s and more.
//!
//! A buffer is known by its region id (a serial number of this process and
//! the memory file's descriptor); a peer maps it through
//! `/proc/<pid>/fd/<fd>`, which the kernel allows where it allows
//! cross-memory attach, after checking that the file behind that
//! descriptor is the buffer's memory file.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    ffi::{c_void, CString},
    fs::{File, OpenOptions},
    io,
    num::NonZeroUsize,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    ptr::NonNull,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
};

use ccl_core::{Region, Remote};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};

/// Every shared buffer of this process: its start, length and region id.
static REGIONS: Mutex<BTreeMap<usize, (usize, u64)>> = Mutex::new(BTreeMap::new());

/// Serial numbers of this process's shared buffers; 0 is none.
static SERIAL: AtomicU64 = AtomicU64::new(1);

/// How many regions of its peers a board keeps mapped; beyond that it
/// unmaps the one it mapped first (mapping it again when it is next used).
const MAPPED_MAX: usize = 64;

/// The name of the memory file of the buffer with serial number `serial`.
fn file_name(serial: u64) -> String {
    format!("ccl-region-{serial}")
}

/// A mapping of a memory file, unmapped on drop.
struct Mapping {
    ptr: NonNull<c_void>,
    len: usize,
}

// SAFETY: plain shared memory; who writes which bytes when is the business
// of the buffer's owner and of the collectives' posts.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `file`, shared, readable and writable; with
    /// `populate`, with every page entered into this process's page tables
    /// at once (a peer's region, read whole by the first copy anyway).
    fn new(file: &File, len: usize, populate: bool) -> io::Result<Mapping> {
        let size = NonZeroUsize::new(len)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "an empty region"))?;
        let flags = match populate {
            true => MapFlags::MAP_SHARED | MapFlags::MAP_POPULATE,
            false => MapFlags::MAP_SHARED,
        };
        // SAFETY: a new shared mapping of a file; nothing in this process
        // refers to the address range it returns.
        let ptr = unsafe {
            mmap(
                None,
                size,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                flags,
                file,
                0,
            )
        }?;
        Ok(Mapping { ptr, len })
    }

    fn start(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with this length; no reference into it outlives `self`.
        let _ = unsafe { munmap(self.ptr, self.len) };
    }
}

/// Host memory that the other ranks of this host copy directly, with
/// their own loads and stores, when a collective's buffer lies in it
/// (ccl's counterpart of `ncclMemAlloc`): allgather, all-to-all,
/// broadcast, gather and scatter over shared memory copy their large
/// blocks about twice as fast out of it as out of other memory. Zeroed
/// when allocated. Peers keep their mapping after it is dropped, until
/// their communicator ends or maps many other buffers, so its memory
/// returns to the system only then.
pub struct SharedBuffer {
    map: Mapping,
    id: u64,
    _file: File,
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedBuffer({} bytes, region {:#x})",
            self.map.len, self.id
        )
    }
}

impl SharedBuffer {
    /// A new buffer of `len` bytes (at least 1), every page allocated, so
    /// that a full `/dev/shm` is an error here and not a SIGBUS later.
    pub fn new(len: usize) -> ccl_core::Result<SharedBuffer> {
        if len == 0 {
            return Err(ccl_core::Error::InvalidArgument(
                "a shared buffer of 0 bytes (at least 1)".into(),
            ));
        }
        SharedBuffer::allocate(len)
            .map_err(|e| ccl_core::Error::io(format!("allocating {len} bytes of shared memory"), e))
    }

    fn allocate(len: usize) -> io::Result<SharedBuffer> {
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let name = CString::new(file_name(serial)).expect("no NUL in the name");
        // SAFETY: memfd_create takes a NUL-terminated name and flags, and
        // returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to this thread, owned by no one else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len as u64)?;
        nix::fcntl::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t)?;
        let map = Mapping::new(&file, len, false)?;
        let id = serial << 32 | u64::from(fd as u32);
        lock(&REGIONS).insert(map.start() as usize, (len, id));
        Ok(SharedBuffer {
            map,
            id,
            _file: file,
        })
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Always false: a shared buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Where its bytes start, for views of it in other languages (C,
    /// Python), which may write through it.
    pub fn ptr(&self) -> *mut u8 {
        self.map.start()
    }

    /// Its bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: mapped, readable, `len` bytes, for as long as `self`.
        unsafe { std::slice::from_raw_parts(self.map.start(), self.map.len) }
    }

    /// Its bytes, to write.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.map.start(), self.map.len) }
    }

    /// Its first `len / size_of::<T>()` elements of type `T`.
    pub fn as_slice<T: bytemuck::Pod>(&self) -> &[T] {
        let whole = self.len() / std::mem::size_of::<T>().max(1) * std::mem::size_of::<T>();
        bytemuck::cast_slice(&self.as_bytes()[..whole])
    }

    /// Its first `len / size_of::<T>()` elements of type `T`, to write.
    pub fn as_mut_slice<T: bytemuck::Pod>(&mut self) -> &mut [T] {
        let whole = self.len() / std::mem::size_of::<T>().max(1) * std::mem::size_of::<T>();
        bytemuck::cast_slice_mut(&mut self.as_bytes_mut()[..whole])
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        lock(&REGIONS).remove(&(self.map.start() as usize));
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The shared buffer of this process that holds the `len` bytes at `addr`,
/// if one does.
pub(crate) fn region_of(addr: u64, len: usize) -> Region {
    let regions = lock(&REGIONS);
    let Some((&start, &(size, id))) = regions.range(..=addr as usize).next_back() else {
        return Region::default();
    };
    match (addr as usize).checked_add(len) {
        Some(end) if end <= start + size => Region {
            id,
            base: start as u64,
        },
        _ => Region::default(),
    }
}

/// Logs the first refusal to map a peer's region in this process.
static MAP_REFUSED: AtomicBool = AtomicBool::new(false);

/// The regions of other ranks that one board (or link) mapped, by rank and
/// region id.
#[derive(Default)]
pub(crate) struct PeerRegions {
    mapped: Mutex<Mapped>,
}

#[derive(Default)]
struct Mapped {
    by_id: HashMap<(usize, u64), Arc<Mapping>>,
    /// The order they were mapped in, oldest first.
    order: VecDeque<(usize, u64)>,
}

/// `len` bytes of a peer's region, mapped here; valid while it is held.
pub(crate) struct Window {
    map: Arc<Mapping>,
    at: usize,
    len: usize,
}

impl Window {
    /// The bytes, to read.
    ///
    /// # Safety
    /// No one writes them while the slice lives (the collective's posts
    /// make sure of it).
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        std::slice::from_raw_parts(self.map.start().add(self.at), self.len)
    }

    /// The bytes, to write.
    ///
    /// # Safety
    /// No one else touches them while the slice lives (as above).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.map.start().add(self.at), self.len)
    }
}

impl PeerRegions {
    /// The `len` bytes at `at` of rank `rank` (process `pid`), mapped here,
    /// where `at` lies in a region of that process that this process may
    /// map; `None` otherwise (the caller copies through the kernel, which
    /// fails where the address is not that process's memory).
    pub(crate) fn window(&self, rank: usize, pid: i32, at: Remote, len: usize) -> Option<Window> {
        let region = at.region;
        let at_byte = usize::try_from(at.addr.checked_sub(region.base)?).ok()?;
        let key = (rank, region.id);
        let mut mapped = lock(&self.mapped);
        let map = match mapped.by_id.get(&key) {
            Some(map) => map.clone(),
            None => {
                let map = match open(pid, region.id) {
                    Ok(map) => Arc::new(map),
                    Err(e) => {
                        if !MAP_REFUSED.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                "could not map shared buffer {:#x} of rank {rank} (pid {pid}): {e}; copying through the kernel",
                                region.id
                            );
                        }
                        return None;
                    }
                };
                tracing::debug!(
                    "mapped shared buffer {:#x} of rank {rank} ({} bytes)",
                    region.id,
                    map.len
                );
                if mapped.order.len() == MAPPED_MAX {
                    let oldest = mapped.order.pop_front().expect("full");
                    mapped.by_id.remove(&oldest);
                }
                mapped.order.push_back(key);
                mapped.by_id.insert(key, map.clone());
                map
            }
        };
        (at_byte.checked_add(len)? <= map.len).then_some(Window {
            map,
            at: at_byte,
            len,
        })
    }
}

/// Maps region `id` of process `pid`: the memory file behind descriptor
/// `id & 0xffff_ffff` there, which must be the one with the id's serial
/// number (a descriptor closed and reused since is not).
fn open(pid: i32, id: u64) -> io::Result<Mapping> {
    let (serial, fd) = (id >> 32, id as u32);
    let path = format!("/proc/{pid}/fd/{fd}");
    let expect = format!("/memfd:{} (deleted)", file_name(serial));
    let check = |link: std::path::PathBuf| match link.as_os_str() == expect.as_str() {
        true => Ok(()),
        false => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{path} is {}, not {expect}", link.display()),
        )),
    };
    check(std::fs::read_link(&path)?)?;
    let file = OpenOptions::new().read(true).write(true).open(&path)?;
    // The descriptor may have been reused between the two looks: look at
    // what was opened.
    check(std::fs::read_link(format!(
        "/proc/self/fd/{}",
        file.as_raw_fd()
    ))?)?;
    let len = usize::try_from(file.metadata()?.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "a region too large to map"))?;
    Mapping::new(&file, len, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_found_by_any_range_inside_it() {
        assert!(matches!(
            SharedBuffer::new(0),
            Err(ccl_core::Error::InvalidArgument(_))
        ));
        let mut buf = SharedBuffer::new(3 * 4096 + 5).unwrap();
        assert!(buf.as_bytes().iter().all(|&b| b == 0));
        buf.as_mut_slice::<u32>()[7] = 9;
        let start = buf.as_bytes().as_ptr() as u64;
        let region = region_of(start + 100, 4096);
        assert_eq!(region.base, start);
        assert_eq!(region.id & 0xffff_ffff, buf._file.as_raw_fd() as u64);
        assert_eq!(region_of(start, buf.len()), region);
        assert_eq!(region_of(start + 1, buf.len()), Region::default());
        assert_eq!(region_of(start - 1, 2), Region::default());
        drop(buf);
        assert_eq!(region_of(start + 100, 4096), Region::default());
    }

    /// A region mapped a second time (as a peer would, here through this
    /// process's own descriptors) shows the same bytes both ways; a window
    /// out of its bounds or a stale id is refused.
    #[test]
    fn a_peer_maps_the_region_it_was_told_of() {
        let mut buf = SharedBuffer::new(8192).unwrap();
        buf.as_bytes_mut()[4096..4100].copy_from_slice(&[1, 2, 3, 4]);
        let start = buf.as_bytes().as_ptr() as u64;
        let at = Remote {
            addr: start + 4096,
            region: region_of(start, 1),
        };
        let peers = PeerRegions::default();
        let pid = std::process::id() as i32;
        let window = peers.window(1, pid, at, 4).expect("mapped");
        // SAFETY: nothing else touches these bytes during the test.
        assert_eq!(unsafe { window.bytes() }, [1, 2, 3, 4]);
        unsafe { window.bytes_mut()[0] = 7 };
        assert_eq!(buf.as_bytes()[4096], 7);
        assert!(peers.window(1, pid, at, 4097).is_none(), "past the end");
        let stale = Remote {
            region: Region {
                id: at.region.id + (1 << 32),
                ..at.region
            },
            ..at
        };
        assert!(peers.window(2, pid, stale, 4).is_none(), "another serial");
        let other = SharedBuffer::new(1).unwrap();
        assert_ne!(region_of(other.as_bytes().as_ptr() as u64, 1), at.region);
    }
}
