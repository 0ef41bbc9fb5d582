//! The glue to a real NIC: [`Verbs`] on libibverbs, through `ibverbs-sys`,
//! the raw bindings of the `ibverbs` project (the safe `ibverbs` crate
//! cannot register memory it did not allocate, nor post RDMA writes). Built
//! only with the `ibverbs` feature, since it links libibverbs.
//!
//! One protection domain per NIC; per peer one reliable-connected queue
//! pair with its own completion queue, all of a communicator's completion
//! queues on one completion channel (non-blocking, slept on by the links).
//! Every write is signaled; receives carry no buffer (writes with immediate
//! land in the peer's registered ring, the receive only reports the
//! immediate and the length). Writes beyond what the send queue holds wait
//! in a backlog and are posted as completions free room, so the protocol
//! core never sees a full queue.
//! A write longer than the port's largest message is split into several
//! work requests, of which only the last is signaled and carries the
//! immediate.
//!
//! This file cannot run on the machines the project is developed on (they
//! have no RDMA device); it builds in CI, and the real-device test runs it
//! wherever `ibv_devices` lists one.

use std::{
    collections::{HashMap, VecDeque},
    ffi::CStr,
    os::fd::{AsRawFd, RawFd},
    ptr,
    sync::{Arc, Mutex},
};

use ibverbs_sys as ffi;

use crate::verbs::{Channel, Completion, Endpoint, QueuePair, Region, Status, Verbs, Write};

/// Work requests a send queue holds (fewer if the device allows fewer).
/// Where a loaded GPU peer-memory client shows: `nvidia-peermem` (driver
/// 470 on), or Mellanox's older `nv_peer_mem`.
const PEER_MEMORY_MODULES: [&str; 2] = [
    "/sys/module/nvidia_peermem",
    "/sys/kernel/mm/memory_peers/nv_mem/version",
];

const SEND_DEPTH: u32 = 1024;
/// Receives a queue pair holds (the protocol posts `2 × slots + 3`; the
/// largest ring the knobs allow is 4 095 slots).
const RECV_DEPTH: u32 = 8192 + 2;
/// The `wr_id` of every receive (the protocol's write ids start at 1 and
/// never reach it), so that a failed completion, whose opcode is not
/// valid, still tells receives from writes.
const RECV_ID: u64 = u64::MAX;
/// Completions taken per `ibv_poll_cq`.
const POLL_BATCH: usize = 32;
/// Ack timeout exponent (4.096 µs × 2^14 ≈ 67 ms) and retries: a peer whose
/// NIC stops answering fails the queue pair in about half a second.
const ACK_TIMEOUT: u8 = 14;
const RETRIES: u8 = 7;
/// Receiver-not-ready retries: 7 means without limit (the protocol's
/// credits keep receives posted ahead of every write with immediate).
const RNR_RETRIES: u8 = 7;
/// Minimum RNR NAK timer (12: 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;

/// The device's context and protection domain, shared by its queue pairs.
struct Device {
    context: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    port: u8,
    port_attr: ffi::ibv_port_attr,
    /// The GID and its index where the port needs global routing (RoCE).
    gid: Option<(u8, [u8; 16])>,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_cqe: i32,
}

// SAFETY: libibverbs objects may be used from any thread; the pointers are
// only freed on drop, when nothing else holds the device.
unsafe impl Send for Device {}
unsafe impl Sync for Device {}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: both were created in `IbvNic::open` and every queue pair
        // and registration holding them is gone (they hold the `Arc`).
        unsafe {
            ffi::ibv_dealloc_pd(self.pd);
            ffi::ibv_close_device(self.context);
        }
    }
}

/// A NIC opened through libibverbs.
pub struct IbvNic {
    name: String,
    device: Arc<Device>,
    /// The NIC pages host registrations on demand (`IBV_ACCESS_ON_DEMAND`
    /// was accepted at open): they follow the address space.
    on_demand: bool,
    /// Live registrations by local key.
    regions: Mutex<HashMap<u32, MemoryRegion>>,
}

/// An `ibv_mr` pointer that may move between threads.
struct MemoryRegion(*mut ffi::ibv_mr);

// SAFETY: an `ibv_mr` is only read after registration and freed once.
unsafe impl Send for MemoryRegion {}

impl IbvNic {
    /// Opens `wanted` (`name` or `name:port`; the first device, port 1,
    /// otherwise) and its port; `gid_index` overrides the GID chosen for
    /// RoCE. The error says what was found.
    pub fn open(wanted: Option<&str>, gid_index: Option<u32>) -> Result<IbvNic, String> {
        let (want_name, port) = match wanted.map(|w| w.split_once(':').unwrap_or((w, "1"))) {
            Some((n, p)) => (
                Some(n),
                p.parse::<u8>()
                    .map_err(|_| format!("CCL_RDMA_DEVICE={}: bad port {p:?}", n))?,
            ),
            None => (None, 1),
        };
        let mut n = 0;
        // SAFETY: returns an array of `n` devices (or null), freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(format!(
                "no RDMA device (ibv_get_device_list: {})",
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: the list holds `n` valid device pointers until it is freed.
        let devices = unsafe { std::slice::from_raw_parts(list, n.max(0) as usize) };
        let names: Vec<String> = devices
            .iter()
            // SAFETY: each device has a NUL-terminated name.
            .map(|&d| unsafe { CStr::from_ptr(ffi::ibv_get_device_name(d)) })
            .map(|c| c.to_string_lossy().into_owned())
            .collect();
        let pick = match want_name {
            Some(w) => names.iter().position(|n| n == w),
            None => (!names.is_empty()).then_some(0),
        };
        let opened = pick.map(|i| {
            // SAFETY: a device from the list, opened before the list is freed.
            let context = unsafe { ffi::ibv_open_device(devices[i]) };
            (i, context)
        });
        // SAFETY: the list came from ibv_get_device_list; opened devices stay valid.
        unsafe { ffi::ibv_free_device_list(list) };
        let (i, context) = match opened {
            Some((i, c)) if !c.is_null() => (i, c),
            Some((i, _)) => {
                return Err(format!(
                    "RDMA device {}: ibv_open_device failed: {}",
                    names[i],
                    std::io::Error::last_os_error()
                ))
            }
            None if names.is_empty() => {
                return Err("no RDMA device (ibv_get_device_list lists none)".into())
            }
            None => {
                return Err(format!(
                    "no RDMA device named {} (there are {})",
                    want_name.unwrap_or_default(),
                    names.join(", ")
                ))
            }
        };
        let name = format!("{}:{port}", names[i]);
        // From here on, `Device`'s drop closes the context.
        let mut device = Device {
            context,
            pd: ptr::null_mut(),
            port,
            port_attr: ffi::ibv_port_attr::default(),
            gid: None,
            max_send_wr: 0,
            max_recv_wr: 0,
            max_cqe: 0,
        };
        let fail = |what: &str, e: std::io::Error| format!("RDMA device {name}: {what}: {e}");
        // SAFETY: the context is open; the full `ibv_port_attr` is what the
        // library fills (the compat type only names the symbol's version).
        let errno = unsafe {
            ffi::ibv_query_port(
                context,
                port,
                &mut device.port_attr as *mut ffi::ibv_port_attr as *mut _,
            )
        };
        if errno != 0 {
            return Err(fail(
                "ibv_query_port",
                std::io::Error::from_raw_os_error(errno),
            ));
        }
        if device.port_attr.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(format!(
                "RDMA device {name}: port is not active (state {})",
                device.port_attr.state
            ));
        }
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: the context is open.
        let errno = unsafe { ffi::ibv_query_device(context, &mut attr) };
        if errno != 0 {
            return Err(fail(
                "ibv_query_device",
                std::io::Error::from_raw_os_error(errno),
            ));
        }
        device.max_send_wr = SEND_DEPTH.min(attr.max_qp_wr.max(1) as u32);
        device.max_recv_wr = RECV_DEPTH.min(attr.max_qp_wr.max(1) as u32);
        device.max_cqe = attr.max_cqe;
        let ethernet = u32::from(device.port_attr.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
        device.gid = match (gid_index, ethernet) {
            (Some(i), _) => Some((i as u8, query_gid(context, port, i)?)),
            (None, true) => Some(roce_gid(context, &device.port_attr, &name)?),
            (None, false) => None,
        };
        // SAFETY: the context is open.
        device.pd = unsafe { ffi::ibv_alloc_pd(context) };
        if device.pd.is_null() {
            return Err(fail("ibv_alloc_pd", std::io::Error::last_os_error()));
        }
        let on_demand = pages_on_demand(device.pd);
        tracing::debug!(
            device = %name,
            lid = device.port_attr.lid,
            mtu = mtu_bytes(device.port_attr.active_mtu),
            roce = ethernet,
            on_demand,
            "rdma: opened"
        );
        Ok(IbvNic {
            name,
            device: Arc::new(device),
            on_demand,
            regions: Mutex::new(HashMap::new()),
        })
    }
}

/// Whether the NIC of `pd` registers host memory with on-demand paging:
/// a page registered so is accepted (the capability is in
/// `ibv_query_device_ex`, an inline function the bindings lack).
fn pages_on_demand(pd: *mut ffi::ibv_pd) -> bool {
    let page = vec![0u8; 4096];
    let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        | ffi::ibv_access_flags::IBV_ACCESS_ON_DEMAND;
    // SAFETY: `page` outlives the registration, released at once.
    unsafe {
        let mr = ffi::ibv_reg_mr(pd, page.as_ptr() as *mut _, page.len(), access.0 as i32);
        if mr.is_null() {
            return false;
        }
        ffi::ibv_dereg_mr(mr);
    }
    true
}

/// GID `index` of `port`.
fn query_gid(context: *mut ffi::ibv_context, port: u8, index: u32) -> Result<[u8; 16], String> {
    let mut gid = ffi::ibv_gid::default();
    // SAFETY: the context is open; `gid` is written on success.
    let errno = unsafe { ffi::ibv_query_gid(context, port, index as i32, &mut gid) };
    if errno != 0 {
        return Err(format!(
            "ibv_query_gid(port {port}, index {index}): {}",
            std::io::Error::from_raw_os_error(errno.abs())
        ));
    }
    // SAFETY: every bit pattern is a valid `raw` view of the union.
    Ok(unsafe { gid.raw })
}

/// The GID a RoCE port routes by, as NCCL picks it by default: RoCE v2 with
/// an IPv4-mapped address, else any RoCE v2, else the first entry.
fn roce_gid(
    context: *mut ffi::ibv_context,
    port_attr: &ffi::ibv_port_attr,
    name: &str,
) -> Result<(u8, [u8; 16]), String> {
    let mut table = vec![ffi::ibv_gid_entry::default(); port_attr.gid_tbl_len.max(0) as usize];
    // SAFETY: the context is open; the table holds `table.len()` entries.
    let n = unsafe {
        ffi::_ibv_query_gid_table(
            context,
            table.as_mut_ptr(),
            table.len(),
            0,
            std::mem::size_of::<ffi::ibv_gid_entry>(),
        )
    };
    if n < 0 {
        return Err(format!(
            "RDMA device {name}: ibv_query_gid_table: {}",
            std::io::Error::from_raw_os_error(-n as i32)
        ));
    }
    table.truncate(n as usize);
    // SAFETY: every bit pattern is a valid `raw` view of the union.
    let raw = |e: &ffi::ibv_gid_entry| unsafe { e.gid.raw };
    let v4_mapped = |g: &[u8; 16]| g[..10].iter().all(|&b| b == 0) && g[10..12] == [0xff, 0xff];
    let v2 = |e: &&ffi::ibv_gid_entry| e.gid_type == ffi::IBV_GID_TYPE_ROCE_V2;
    table
        .iter()
        .filter(v2)
        .find(|e| v4_mapped(&raw(e)))
        .or_else(|| table.iter().find(v2))
        .or_else(|| table.first())
        .map(|e| (e.gid_index as u8, raw(e)))
        .ok_or_else(|| {
            format!("RDMA device {name}: RoCE port without a GID (set CCL_RDMA_GID_INDEX)")
        })
}

/// Bytes of an `ibv_mtu`.
fn mtu_bytes(mtu: ffi::ibv_mtu) -> u32 {
    128 << mtu.clamp(1, 5)
}

/// The `ibv_mtu` of `bytes` (the largest not above it).
fn mtu_enum(bytes: u32) -> ffi::ibv_mtu {
    (1..=5).rev().find(|&m| mtu_bytes(m) <= bytes).unwrap_or(1)
}

impl IbvNic {
    /// `ibv_reg_mr` of `[addr, addr + len)` for local writes and remote
    /// writes, paged on demand where `on_demand` says so.
    fn reg_mr(&self, addr: u64, len: usize, on_demand: bool) -> Result<Region, String> {
        let mut access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        if on_demand {
            access |= ffi::ibv_access_flags::IBV_ACCESS_ON_DEMAND;
        }
        // SAFETY: the caller keeps `[addr, addr + len)` mapped while registered
        // (the registration cache drops it before the memory goes).
        let mr =
            unsafe { ffi::ibv_reg_mr(self.device.pd, addr as *mut _, len.max(1), access.0 as i32) };
        if mr.is_null() {
            return Err(format!(
                "ibv_reg_mr of {len} bytes on {}: {}",
                self.name,
                std::io::Error::last_os_error()
            ));
        }
        // SAFETY: a registration just returned by the library.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        self.regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(lkey, MemoryRegion(mr));
        Ok(Region {
            addr,
            len,
            lkey,
            rkey,
        })
    }
}

impl Verbs for IbvNic {
    type Qp = IbvQp;
    type Channel = IbvChannel;

    fn name(&self) -> String {
        self.name.clone()
    }

    fn register(&self, addr: u64, len: usize) -> Result<Region, String> {
        self.reg_mr(addr, len, self.on_demand)
    }

    /// GPU memory through the peer-memory client that NVIDIA's driver
    /// installs (`nvidia-peermem`): `ibv_reg_mr` then takes a device
    /// address as it takes a host one.
    fn device_memory(&self) -> Result<(), String> {
        match PEER_MEMORY_MODULES
            .iter()
            .find(|m| std::path::Path::new(m).exists())
        {
            Some(_) => Ok(()),
            None => Err(format!(
                "{}: no GPU peer-memory client loaded (checked {}; `modprobe nvidia-peermem`)",
                self.name,
                PEER_MEMORY_MODULES.join(", ")
            )),
        }
    }

    fn register_device(&self, addr: u64, len: usize) -> Result<Region, String> {
        self.device_memory()?;
        self.reg_mr(addr, len, false)
    }

    fn deregister(&self, region: &Region) {
        let mr = self
            .regions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&region.lkey);
        if let Some(MemoryRegion(mr)) = mr {
            // SAFETY: registered by `register`, removed from the table, so freed once.
            let errno = unsafe { ffi::ibv_dereg_mr(mr) };
            if errno != 0 {
                tracing::warn!(device = %self.name, "ibv_dereg_mr: errno {errno}");
            }
        }
    }

    /// Host registrations follow the address space where the NIC pages
    /// them on demand; elsewhere they pin pages.
    fn follows_remaps(&self) -> bool {
        self.on_demand
    }

    fn channel(&self) -> Result<IbvChannel, String> {
        IbvChannel::new(self.device.clone()).map_err(|e| format!("RDMA device {}: {e}", self.name))
    }

    fn queue_pair(&self, channel: &IbvChannel) -> Result<IbvQp, String> {
        IbvQp::new(self.device.clone(), channel.0.clone())
            .map_err(|e| format!("RDMA device {}: {e}", self.name))
    }
}

impl Drop for IbvNic {
    fn drop(&mut self) {
        let regions = std::mem::take(self.regions.get_mut().unwrap_or_else(|p| p.into_inner()));
        for (_, MemoryRegion(mr)) in regions {
            // SAFETY: each was registered by `register` and not yet freed.
            unsafe { ffi::ibv_dereg_mr(mr) };
        }
    }
}

/// A completion channel (`ibv_comp_channel`) with a non-blocking descriptor.
pub struct IbvChannel(Arc<ChannelHandle>);

/// Destroyed once the last completion queue made with it is gone.
struct ChannelHandle {
    channel: *mut ffi::ibv_comp_channel,
    _device: Arc<Device>,
}

// SAFETY: a completion channel may be used from any thread.
unsafe impl Send for ChannelHandle {}
unsafe impl Sync for ChannelHandle {}

impl IbvChannel {
    fn new(device: Arc<Device>) -> Result<IbvChannel, String> {
        // SAFETY: the context is open while `device` lives.
        let channel = unsafe { ffi::ibv_create_comp_channel(device.context) };
        if channel.is_null() {
            return Err(format!(
                "ibv_create_comp_channel: {}",
                std::io::Error::last_os_error()
            ));
        }
        let handle = ChannelHandle {
            channel,
            _device: device,
        };
        // SAFETY: the channel's own descriptor.
        let fd = unsafe { (*channel).fd };
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(format!(
                "making the completion channel non-blocking: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(IbvChannel(Arc::new(handle)))
    }
}

impl AsRawFd for IbvChannel {
    fn as_raw_fd(&self) -> RawFd {
        // SAFETY: a live channel.
        unsafe { (*self.0.channel).fd }
    }
}

impl Channel for IbvChannel {
    fn drain(&self) {
        let (mut cq, mut context) = (ptr::null_mut(), ptr::null_mut());
        // SAFETY: a live, non-blocking channel; each event is acknowledged
        // on the queue it names, which lives: `ibv_destroy_cq` waits until
        // every event it handed out is acknowledged, which happens here.
        while unsafe { ffi::ibv_get_cq_event(self.0.channel, &mut cq, &mut context) } == 0 {
            unsafe { ffi::ibv_ack_cq_events(cq, 1) };
        }
    }
}

impl Drop for ChannelHandle {
    fn drop(&mut self) {
        // SAFETY: created in `IbvChannel::new`; every queue made with it is gone.
        let errno = unsafe { ffi::ibv_destroy_comp_channel(self.channel) };
        if errno != 0 {
            tracing::warn!("ibv_destroy_comp_channel: errno {errno}");
        }
    }
}

/// One reliable-connected queue pair and its completion queue.
pub struct IbvQp {
    device: Arc<Device>,
    /// The channel the completion queue notifies; outlives the queue.
    _channel: Arc<ChannelHandle>,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    psn: u32,
    /// Work requests on the send queue (signaled or not) not yet completed.
    in_flight: u32,
    /// Send queue entries each posted write holds, in posting order (RC
    /// completes them in order).
    posted: VecDeque<u32>,
    /// Writes waiting for room on the send queue.
    backlog: VecDeque<Write>,
}

// SAFETY: a queue pair is used by one thread at a time (the link's lock).
unsafe impl Send for IbvQp {}

impl IbvQp {
    fn new(device: Arc<Device>, channel: Arc<ChannelHandle>) -> Result<IbvQp, String> {
        let cqe = (device.max_send_wr + device.max_recv_wr) as i32;
        let cqe = if device.max_cqe > 0 {
            cqe.min(device.max_cqe)
        } else {
            cqe
        };
        // SAFETY: the context is open while `device` lives.
        let cq =
            unsafe { ffi::ibv_create_cq(device.context, cqe, ptr::null_mut(), channel.channel, 0) };
        if cq.is_null() {
            return Err(format!(
                "ibv_create_cq: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq,
            recv_cq: cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: device.max_send_wr,
                max_recv_wr: device.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the protection domain and completion queue are live.
        let qp = unsafe { ffi::ibv_create_qp(device.pd, &mut init) };
        if qp.is_null() {
            let e = std::io::Error::last_os_error();
            // SAFETY: created above, used by nothing.
            unsafe { ffi::ibv_destroy_cq(cq) };
            return Err(format!("ibv_create_qp: {e}"));
        }
        let mut seed = [0u8; 4];
        let psn = match getrandom_bytes(&mut seed) {
            // SAFETY: a live queue pair.
            false => unsafe { (*qp).qp_num }.wrapping_mul(0x9e37_79b1),
            true => u32::from_le_bytes(seed),
        } & 0xff_ffff;
        Ok(IbvQp {
            device,
            _channel: channel,
            cq,
            qp,
            psn,
            in_flight: 0,
            posted: VecDeque::new(),
            backlog: VecDeque::new(),
        })
    }

    fn modify(
        &mut self,
        attr: &mut ffi::ibv_qp_attr,
        mask: ffi::ibv_qp_attr_mask,
        to: &str,
    ) -> Result<(), String> {
        // SAFETY: a live queue pair; `attr` holds what `mask` names.
        let errno = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as i32) };
        if errno != 0 {
            return Err(format!(
                "ibv_modify_qp to {to}: {}",
                std::io::Error::from_raw_os_error(errno)
            ));
        }
        Ok(())
    }

    /// Send queue entries `write` takes (one per piece of at most the
    /// port's largest message).
    fn entries(&self, write: &Write) -> u32 {
        let max = self.device.port_attr.max_msg_sz.max(1) as usize;
        write.len.div_ceil(max).max(1) as u32
    }

    /// Posts `write` now; the caller checked that the send queue has room.
    fn post_now(&mut self, write: &Write) -> Result<(), String> {
        let max = self.device.port_attr.max_msg_sz.max(1) as usize;
        let pieces = self.entries(write) as usize;
        let mut sges = Vec::with_capacity(pieces);
        let mut wrs: Vec<ffi::ibv_send_wr> = Vec::with_capacity(pieces);
        for i in 0..pieces {
            let at = i * max;
            let len = write.len.saturating_sub(at).min(max);
            sges.push(ffi::ibv_sge {
                addr: write.addr + at as u64,
                length: len as u32,
                lkey: write.lkey,
            });
            let last = i + 1 == pieces;
            let mut wr = ffi::ibv_send_wr {
                wr_id: write.id,
                num_sge: i32::from(len > 0),
                opcode: match (last, write.imm) {
                    (true, Some(_)) => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                    _ => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                },
                send_flags: if last {
                    ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                } else {
                    0
                },
                ..Default::default()
            };
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                remote_addr: write.remote.addr + at as u64,
                rkey: write.remote.rkey,
            };
            if last {
                // The immediate travels in network byte order.
                wr.__bindgen_anon_1.imm_data = write.imm.unwrap_or(0).to_be();
            }
            wrs.push(wr);
        }
        // Chain them; the vectors no longer grow, so the pointers stay put.
        for i in 0..pieces {
            wrs[i].sg_list = if wrs[i].num_sge > 0 {
                &mut sges[i]
            } else {
                ptr::null_mut()
            };
            wrs[i].next = if i + 1 < pieces {
                &mut wrs[i + 1]
            } else {
                ptr::null_mut()
            };
        }
        let mut bad = ptr::null_mut();
        // SAFETY: a live, connected queue pair; the work requests and their
        // scatter lists live until the call returns (the library copies
        // them); the memory they name is registered and kept by the caller
        // until the completion.
        let errno = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_send {
                Some(post_send) => post_send(self.qp, wrs.as_mut_ptr(), &mut bad),
                None => libc::ENOSYS,
            }
        };
        if errno != 0 {
            return Err(format!(
                "ibv_post_send: {}",
                std::io::Error::from_raw_os_error(errno)
            ));
        }
        self.in_flight += pieces as u32;
        self.posted.push_back(pieces as u32);
        Ok(())
    }

    /// Posts backlogged writes while the send queue has room.
    fn flush_backlog(&mut self) -> Result<(), String> {
        while let Some(next) = self.backlog.front().copied() {
            if self.in_flight + self.entries(&next) > self.device.max_send_wr {
                break;
            }
            self.backlog.pop_front();
            self.post_now(&next)?;
        }
        Ok(())
    }
}

/// Fills `buf` from the kernel's random source; whether it could.
fn getrandom_bytes(buf: &mut [u8]) -> bool {
    // SAFETY: writes at most `buf.len()` bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    n == buf.len() as isize
}

impl QueuePair for IbvQp {
    fn endpoint(&self) -> Endpoint {
        let attr = &self.device.port_attr;
        Endpoint {
            // SAFETY: a live queue pair.
            qpn: unsafe { (*self.qp).qp_num },
            lid: attr.lid,
            gid: self.device.gid.map(|(_, g)| g).unwrap_or_default(),
            psn: self.psn,
            mtu: mtu_bytes(attr.active_mtu),
        }
    }

    fn connect(&mut self, remote: &Endpoint) -> Result<(), String> {
        use ffi::ibv_qp_attr_mask as m;
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
        let mut init = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: self.device.port,
            qp_access_flags: access.0,
            ..Default::default()
        };
        self.modify(
            &mut init,
            m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;
        let mut rtr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: mtu_enum(remote.mtu.min(mtu_bytes(self.device.port_attr.active_mtu))),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: MIN_RNR_TIMER,
            ah_attr: ffi::ibv_ah_attr {
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                port_num: self.device.port,
                ..Default::default()
            },
            ..Default::default()
        };
        if let Some((index, _)) = self.device.gid {
            rtr.ah_attr.is_global = 1;
            rtr.ah_attr.grh.dgid.raw = remote.gid;
            rtr.ah_attr.grh.sgid_index = index;
            rtr.ah_attr.grh.hop_limit = 0xff;
        }
        self.modify(
            &mut rtr,
            m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut rts = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn: self.psn,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRIES,
            rnr_retry: RNR_RETRIES,
            max_rd_atomic: 1,
            ..Default::default()
        };
        self.modify(
            &mut rts,
            m::IBV_QP_STATE
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    fn post_write(&mut self, write: &Write) -> Result<(), String> {
        if self.entries(write) > self.device.max_send_wr {
            return Err(format!(
                "a write of {} bytes needs more work requests than the send queue holds ({})",
                write.len, self.device.max_send_wr
            ));
        }
        self.backlog.push_back(*write);
        self.flush_backlog()
    }

    fn post_recv(&mut self) -> Result<(), String> {
        let mut wr = ffi::ibv_recv_wr {
            wr_id: RECV_ID,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: a live queue pair; a receive without a buffer.
        let errno = unsafe {
            let ctx = (*self.qp).context;
            match (*ctx).ops.post_recv {
                Some(post_recv) => post_recv(self.qp, &mut wr, &mut bad),
                None => libc::ENOSYS,
            }
        };
        if errno != 0 {
            return Err(format!(
                "ibv_post_recv: {}",
                std::io::Error::from_raw_os_error(errno)
            ));
        }
        Ok(())
    }

    fn poll(&mut self, out: &mut Vec<Completion>) {
        // SAFETY: `ibv_wc` is plain integers; all zeros is a valid value.
        let mut wcs: [ffi::ibv_wc; POLL_BATCH] = unsafe { std::mem::zeroed() };
        loop {
            // SAFETY: a live completion queue; `wcs` holds POLL_BATCH entries.
            let n = unsafe {
                let ctx = (*self.cq).context;
                match (*ctx).ops.poll_cq {
                    Some(poll_cq) => poll_cq(self.cq, POLL_BATCH as i32, wcs.as_mut_ptr()),
                    None => -1,
                }
            };
            if n < 0 {
                // The queue itself failed: fail every write still owed, so
                // that the protocol reports the pair as lost.
                let owed = self.posted.len();
                out.extend((0..owed).map(|_| Completion::Write {
                    id: 0,
                    status: Status::Other("ibv_poll_cq failed".into()),
                }));
                self.posted.clear();
                self.in_flight = 0;
                return;
            }
            for wc in &wcs[..n as usize] {
                let status = status(wc);
                if wc.wr_id() == RECV_ID {
                    out.push(Completion::Recv {
                        imm: u32::from_be(wc.imm_data),
                        len: wc.len(),
                        status,
                    });
                } else {
                    let entries = self.posted.pop_front().unwrap_or(1);
                    self.in_flight = self.in_flight.saturating_sub(entries);
                    out.push(Completion::Write {
                        id: wc.wr_id(),
                        status,
                    });
                }
            }
            if (n as usize) < POLL_BATCH {
                break;
            }
        }
        if let Err(e) = self.flush_backlog() {
            // A write that cannot be posted fails like one the NIC refused.
            let failed = self.backlog.drain(..).map(|w| Completion::Write {
                id: w.id,
                status: Status::Other(e.clone()),
            });
            out.extend(failed);
        }
    }

    /// Writes still in the backlog are posted only by a poll: no sleep then.
    fn arm(&mut self) -> bool {
        if !self.backlog.is_empty() {
            return false;
        }
        // SAFETY: a live completion queue made with a channel.
        let errno = unsafe {
            let ctx = (*self.cq).context;
            match (*ctx).ops.req_notify_cq {
                Some(req_notify_cq) => req_notify_cq(self.cq, 0),
                None => libc::ENOSYS,
            }
        };
        errno == 0
    }
}

/// The protocol's view of a completion's status.
fn status(wc: &ffi::ibv_wc) -> Status {
    use ffi::ibv_wc_status as s;
    match wc.error() {
        None => Status::Success,
        Some((s::IBV_WC_RETRY_EXC_ERR, _)) => Status::RetryExceeded,
        Some((s::IBV_WC_RNR_RETRY_EXC_ERR, _)) => Status::RnrRetryExceeded,
        Some((s::IBV_WC_REM_ACCESS_ERR, _)) => Status::RemoteAccess,
        Some((s::IBV_WC_WR_FLUSH_ERR, _)) => Status::Flushed,
        Some((other, vendor)) => {
            // SAFETY: returns a static NUL-terminated string for any status.
            let text = unsafe { CStr::from_ptr(ffi::ibv_wc_status_str(other)) };
            Status::Other(format!(
                "RDMA completion failed: {} (vendor error {vendor:#x})",
                text.to_string_lossy()
            ))
        }
    }
}

impl Drop for IbvQp {
    fn drop(&mut self) {
        // SAFETY: created in `new`; the queue pair goes before its queue,
        // whose events were acknowledged as they were taken (`drain`), and
        // the queue before its channel (`_channel` drops after).
        unsafe {
            ffi::ibv_destroy_qp(self.qp);
            ffi::ibv_destroy_cq(self.cq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtus_convert_both_ways() {
        assert_eq!(mtu_bytes(ffi::IBV_MTU_1024), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(mtu_enum(4096), 5);
        assert_eq!(mtu_enum(3000), 4);
        assert_eq!(mtu_enum(100), 1);
    }

    /// Without a device, opening says so (and names the device asked for).
    #[test]
    fn opening_without_a_device_says_so() {
        if std::path::Path::new(crate::SYSFS_DEVICES).exists() {
            eprintln!("this machine lists RDMA devices: nothing to refuse");
            return;
        }
        let e = IbvNic::open(None, None).err().expect("no device here");
        assert!(e.contains("no RDMA device"), "{e}");
        let e = IbvNic::open(Some("mlx5_9:1"), None)
            .err()
            .expect("no device here");
        assert!(e.contains("no RDMA device"), "{e}");
    }
}
