//! The trust boundary of host back-ends: candidate code runs in a *runner* process that shares
//! nothing with its judge but the buffers of the current call.
//!
//! The judge (the worker, trusted) creates two anonymous memory files: one holding every
//! buffer of the request, one holding the verified compiled kernel. It starts the runner
//! (`ksearch runner`, the same executable) with a cleared environment, in a session and process
//! group of its own, with limits on data memory, threads and core files and a parent-death
//! signal. Before any candidate code is loaded, the runner
//! - maps each buffer into an arena of inaccessible pages, every buffer ending on a page
//!   boundary, so a read or write past its end faults (and is reported as `out_of_bounds`);
//! - leaves the network and the host's System V IPC (new network and IPC namespaces) and, when
//!   started as root, drops to an unprivileged user (so it can read neither its judge's nor the
//!   orchestrator's memory or environment, and can write none of their files), in a user
//!   namespace of its own where the kernel allows one (its thread limit then counts its own
//!   threads only, not other runners');
//! - restricts itself with Landlock (read-only system libraries, no writes anywhere, no
//!   signals to processes outside its domain) where the kernel has it;
//! - installs a seccomp filter: no new processes (threads only), no exec, no signals to other
//!   processes, no tracing or reading of other processes' memory, no sockets, no namespaces, no
//!   System V IPC, message queues, memfds or shared anonymous memory (state that outlives the
//!   runner, memory the data limit does not count), and no remapping of the buffer arena.
//!
//! Each mechanism is probed, never required: what was applied is reported back as the
//! isolation level and printed in the run header. The runner's replies are never believed:
//! the judge times each call itself and checks the outputs. After each answer the runner stops
//! its whole process (SIGSTOP, the call right after the answer), so a thread the kernel left
//! running is frozen before it can finish the work. The judge's clock runs until it sees that
//! stop (an answer can be forged by the candidate, which shares the runner's descriptors; the
//! stop after unfinished work leaves the work undone); it reads outputs while the runner is
//! stopped and continues it only for the next call, so nothing of the candidate runs between
//! two calls, and a call whose outputs are checked looks like any other.

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Inaccessible bytes before, between and after buffers in the runner's arena.
pub const ARENA_GAP: usize = 32 << 20;
/// Buffers start on this alignment inside their slot (the end is padded to it).
pub const ALIGN: usize = 64;
/// Byte written into the slack of a slot, around the payload.
pub const SLACK_BYTE: u8 = 0xCD;

pub fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

pub fn round_up(n: usize, to: usize) -> usize {
    n.div_ceil(to) * to
}

/// Bytes mapped for a buffer of `size` bytes: whole pages, at least one.
pub fn slot_len(size: usize) -> usize {
    round_up(round_up(size, ALIGN).max(1), page())
}

/// Offset of the payload inside its slot: the payload (padded to `ALIGN`) ends the slot.
pub fn payload_offset(size: usize) -> usize {
    slot_len(size) - round_up(size, ALIGN)
}

/// Offset of slot `i` from the arena base, for slots of lengths `lens` (same formula on both
/// sides of the boundary).
pub fn slot_position(lens: &[usize], i: usize) -> usize {
    ARENA_GAP + lens[..i].iter().map(|l| l + ARENA_GAP).sum::<usize>()
}

pub fn arena_len(lens: &[usize]) -> usize {
    slot_position(lens, lens.len())
}

/// The most threads (and processes) a runner's user may have (`RLIMIT_NPROC`).
pub const MAX_THREADS: libc::rlim_t = 4096;

/// Environment variables a runner may see (everything else is dropped).
const RUNNER_ENV: &[&str] = &[
    "OMP_NUM_THREADS",
    "OMP_PROC_BIND",
    "OMP_PLACES",
    "OMP_WAIT_POLICY",
    "LD_LIBRARY_PATH",
];

#[cfg(not(target_os = "linux"))]
fn memfd(_name: &str) -> Result<OwnedFd, String> {
    Err("the CPU back-end's sandboxed runner needs Linux (memfd, seccomp, Landlock)".into())
}

#[cfg(target_os = "linux")]
fn memfd(name: &str) -> Result<OwnedFd, String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: a valid C string; no CLOEXEC so the runner inherits it (closed here after spawn).
    let fd = unsafe { libc::memfd_create(c.as_ptr(), 0) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A running runner and the judge's view of its buffers.
pub struct Runner {
    child: Child,
    cmd: ChildStdin,
    replies: ChildStdout,
    stderr: Arc<Mutex<String>>,
    /// The runner's stderr reached its end (every writer gone).
    stderr_closed: Arc<AtomicBool>,
    shm: *mut u8,
    shm_len: usize,
    /// Offset of each slot in the shared file (= in the judge's mapping).
    shm_offsets: Vec<usize>,
    lens: Vec<usize>,
    /// Arena base address in the runner (for classifying faults).
    pub arena_base: u64,
    /// Isolation actually applied, as the runner set it up before loading candidate code.
    pub isolation: String,
    exited: Option<i32>,
    /// The runner stopped itself after its last answer and is still stopped.
    held: bool,
    /// Peak resident memory of the runner when it ended (bytes; from `wait4`).
    pub peak_rss: u64,
    /// What a call's round trip costs besides the call (the median of empty round trips with
    /// cold caches, answer and stop included), measured before the kernel was loaded.
    pub channel_s: f64,
}

/// Empty round trips measured to calibrate the channel.
const CALIBRATION_TRIPS: usize = 16;
/// Bytes written before each calibration trip, to leave the caches as cold as the judge's flush
/// leaves them before a timed call.
const EVICT_BYTES: usize = 64 << 20;

/// Evict the caches (one buffer per process, made at its first use).
fn evict_caches() {
    static BUF: Mutex<Vec<u8>> = Mutex::new(Vec::new());
    if let Ok(mut b) = BUF.lock() {
        if b.is_empty() {
            b.resize(EVICT_BYTES, 0);
        }
        for x in b.iter_mut().step_by(64) {
            *x = x.wrapping_add(1);
        }
        std::hint::black_box(&mut *b);
    }
}

fn wait4(pid: libc::pid_t, st: &mut i32, flags: i32, peak: &mut u64) -> libc::pid_t {
    // SAFETY: waiting for our own child; rusage is plain data.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        let r = libc::wait4(pid, st, flags, &mut ru);
        if r == pid && (libc::WIFEXITED(*st) || libc::WIFSIGNALED(*st)) {
            *peak = ru.ru_maxrss.max(0) as u64 * 1024;
        }
        r
    }
}

/// How the runner ended, as far as the judge can tell.
pub enum Death {
    /// Killed by a signal; `fault` is the address the runner's handler reported, if any.
    Signal {
        sig: i32,
        fault: Option<u64>,
    },
    Exit(i32),
    /// Its answer channel carried bytes the runner's loop did not write (candidate code wrote
    /// to it: a forged "done"): the run's outputs and time cannot be believed.
    Forged(String),
}

/// The order to run every entry once on `bufs` (slot, payload size) with `dims`.
fn order(bufs: &[(usize, usize)], dims: &[i64]) -> Vec<u8> {
    let mut msg: Vec<u8> = Vec::with_capacity(24 + 16 * bufs.len() + 8 * dims.len());
    msg.extend_from_slice(&1u64.to_le_bytes());
    msg.extend_from_slice(&(bufs.len() as u64).to_le_bytes());
    for (slot, size) in bufs {
        msg.extend_from_slice(&(*slot as u64).to_le_bytes());
        msg.extend_from_slice(&(payload_offset(*size) as u64).to_le_bytes());
    }
    msg.extend_from_slice(&(dims.len() as u64).to_le_bytes());
    for d in dims {
        msg.extend_from_slice(&d.to_le_bytes());
    }
    msg
}

impl Runner {
    /// Start a runner for slots of `sizes` bytes, the kernel in `so` with `entries`.
    pub fn start(exe: &Path, sizes: &[usize], so: &[u8], entries: &[String], mem_limit: u64) -> Result<Runner, String> {
        let lens: Vec<usize> = sizes.iter().map(|s| slot_len(*s)).collect();
        let mut shm_offsets = Vec::with_capacity(lens.len());
        let mut total = 0usize;
        for l in &lens {
            shm_offsets.push(total);
            total += l;
        }
        let shm_fd = memfd("ksearch-buffers")?;
        // SAFETY: ftruncate on our own memfd.
        if unsafe { libc::ftruncate(shm_fd.as_raw_fd(), total.max(1) as libc::off_t) } != 0 {
            return Err(format!("cannot size the buffers: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a shared mapping of the whole file we just sized; unmapped in Drop.
        let shm = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                shm_fd.as_raw_fd(),
                0,
            )
        };
        if shm == libc::MAP_FAILED {
            return Err(format!("cannot map the buffers: {}", std::io::Error::last_os_error()));
        }
        let so_fd = memfd("kernel.so")?;
        {
            // SAFETY: dup gives the File its own descriptor; so_fd stays valid.
            let mut f = unsafe { std::fs::File::from_raw_fd(libc::dup(so_fd.as_raw_fd())) };
            f.write_all(so).map_err(|e| format!("cannot hand the kernel over: {e}"))?;
        }
        let slots: Vec<String> = lens.iter().map(|l| l.to_string()).collect();
        let offs: Vec<String> = shm_offsets.iter().map(|l| l.to_string()).collect();
        let mut cmd = Command::new(exe);
        cmd.arg("runner")
            .arg("--shm-fd")
            .arg(shm_fd.as_raw_fd().to_string())
            .arg("--so-fd")
            .arg(so_fd.as_raw_fd().to_string())
            .arg("--slots")
            .arg(slots.join(","))
            .arg("--offsets")
            .arg(offs.join(","))
            .arg("--entries")
            .arg(entries.join(","))
            .env_clear()
            .env("LANG", "C")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for k in RUNNER_ENV {
            if let Ok(v) = std::env::var(k) {
                cmd.env(k, v);
            }
        }
        // No pre-exec hook: the runner sets its own session, limits and parent-death signal
        // before it loads any candidate code, so the spawn needs no fork of this process (whose
        // pages a fork would write-protect) and can use posix_spawn.
        cmd.arg("--mem-limit").arg(mem_limit.to_string());
        let mut child = cmd.spawn().map_err(|e| format!("INFRA:cannot start the runner: {e}"))?;
        drop(shm_fd);
        drop(so_fd);
        let stdin = child.stdin.take().ok_or("runner has no stdin")?;
        let stdout = child.stdout.take().ok_or("runner has no stdout")?;
        let err = child.stderr.take().ok_or("runner has no stderr")?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let s2 = stderr.clone();
        let stderr_closed = Arc::new(AtomicBool::new(false));
        let closed = stderr_closed.clone();
        std::thread::spawn(move || {
            let mut r = std::io::BufReader::new(err);
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf) {
                if n == 0 {
                    break;
                }
                if let Ok(mut s) = s2.lock() {
                    s.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if s.len() > 64 << 10 {
                        let cut = s.len() - (32 << 10);
                        let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(s.len());
                        s.drain(..cut);
                    }
                }
            }
            closed.store(true, Ordering::Release);
        });
        let mut r = Runner {
            child,
            cmd: stdin,
            replies: stdout,
            stderr,
            stderr_closed,
            shm: shm as *mut u8,
            shm_len: total.max(1),
            shm_offsets,
            lens,
            arena_base: 0,
            isolation: String::new(),
            exited: None,
            held: false,
            peak_rss: 0,
            channel_s: 0.0,
        };
        // Greeting: "H <arena base> <isolation>\n", written before any candidate code is loaded;
        // then "L\n" once the kernel is loaded, or "E <reason>\n".
        let hello = r.read_line()?;
        let mut parts = hello.splitn(3, ' ');
        if parts.next() != Some("H") {
            return Err(format!(
                "INFRA:{}",
                r.died_reason(&format!("runner did not start ({})", hello.trim()))
            ));
        }
        r.arena_base = parts.next().and_then(|s| u64::from_str_radix(s, 16).ok()).unwrap_or(0);
        r.isolation = parts.next().unwrap_or("").trim().to_string();
        // Calibrate the channel while only trusted runner code runs, with the protocol and the
        // code of a call (`run`, `serve_call`) with nothing to call: the order, the answer, the
        // runner stopping itself and the judge seeing the stop, each trip after the caches were
        // evicted (as timed calls are). The median trip is what a call's channel costs.
        let empty = order(&[], &[]);
        let mut trips = Vec::with_capacity(CALIBRATION_TRIPS);
        // The first trip finds the runner waiting on its pipe, not stopped: not counted.
        for trip in 0..=CALIBRATION_TRIPS {
            if trip > 0 {
                evict_caches();
            }
            match r.trip(&empty) {
                Ok((dt, _)) if trip > 0 => trips.push(dt),
                Ok(_) => {}
                Err(_) => return Err(format!("INFRA:{}", r.died_reason("runner died while calibrating"))),
            }
        }
        trips.sort_by(f64::total_cmp);
        r.channel_s = trips.get(trips.len() / 2).copied().filter(|c| c.is_finite()).unwrap_or(0.0);
        r.resume();
        if r.cmd.write_all(&3u64.to_le_bytes()).and_then(|_| r.cmd.flush()).is_err() {
            return Err(format!("INFRA:{}", r.died_reason("runner died before loading the kernel")));
        }
        let loaded = r.read_line()?;
        if let Some(reason) = loaded.strip_prefix("E ") {
            return Err(format!("LOAD:{}", reason.trim()));
        }
        if loaded.trim() != "L" {
            return Err(r.died_reason("runner died while loading the kernel"));
        }
        Ok(r)
    }

    fn read_line(&mut self) -> Result<String, String> {
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        loop {
            match self.replies.read(&mut b) {
                Ok(0) => break,
                Ok(_) => {
                    if b[0] == b'\n' {
                        break;
                    }
                    line.push(b[0]);
                    if line.len() > 4096 {
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("runner channel: {e}")),
            }
        }
        Ok(String::from_utf8_lossy(&line).into_owned())
    }

    fn died_reason(&mut self, what: &str) -> String {
        match self.wait_death() {
            Death::Signal { sig, .. } => format!("{what}: killed by signal {sig}; {}", self.stderr_tail()),
            Death::Exit(c) => format!("{what}: exit {c}; {}", self.stderr_tail()),
            Death::Forged(why) => format!("{what}: {why}"),
        }
    }

    pub fn stderr_tail(&self) -> String {
        let s = self.stderr.lock().map(|s| s.clone()).unwrap_or_default();
        let lines: Vec<&str> = s.lines().filter(|l| !l.starts_with("ksearch-runner fault ")).collect();
        lines[lines.len().saturating_sub(6)..].join(" | ")
    }

    /// The payload of slot `i` in the judge's mapping.
    pub fn payload(&mut self, slot: usize, size: usize) -> &mut [u8] {
        let off = self.shm_offsets[slot] + payload_offset(size);
        debug_assert!(off + size <= self.shm_len);
        // SAFETY: within the mapping (slot_len covers payload_offset + size).
        unsafe { std::slice::from_raw_parts_mut(self.shm.add(off), size) }
    }

    /// The whole slot `i` in the judge's mapping.
    pub fn slot(&mut self, slot: usize) -> &mut [u8] {
        // SAFETY: within the mapping.
        unsafe { std::slice::from_raw_parts_mut(self.shm.add(self.shm_offsets[slot]), self.lens[slot]) }
    }

    /// Run every entry once on `bufs` (slot, payload size) with `dims`; the seconds it took.
    ///
    /// The judge times the round trip itself, from the order to the runner's stop after its
    /// answer; the runner also reports the time it measured around the call. The report is
    /// never believed below what the judge saw minus the channel's calibrated cost (the same
    /// round trip, stop included, measured before any candidate code was loaded), nor above the
    /// round trip: a runner that lies (or a kernel that forges its answer) can gain no more than
    /// that cost, and an honest one is not charged the wake-ups of two processes for every call.
    /// The runner is left stopped.
    pub fn run(&mut self, bufs: &[(usize, usize)], dims: &[i64]) -> Result<f64, Death> {
        let (seen, b) = self.trip(&order(bufs, dims))?;
        // The runner's answer is b'D' and its own clock; anything else on the channel was
        // written by the candidate (it can reach every descriptor of its process).
        if b[0] != b'D' {
            self.kill();
            return Err(Death::Forged(format!(
                "the kernel wrote to the runner's answer channel (a forged reply: it began with byte {:#04x})",
                b[0]
            )));
        }
        self.no_bytes_beyond_answers()?;
        let said = f64::from_le_bytes(b[1..9].try_into().unwrap_or([0; 8]));
        let said = if said.is_finite() { said } else { seen };
        Ok(said.clamp((seen - self.channel_s).max(0.0), seen))
    }

    /// Send one order and time it, from continuing the runner to seeing it stop after its
    /// answer; the seconds, and the answer (waiting on the channel when the runner stopped).
    fn trip(&mut self, msg: &[u8]) -> Result<(f64, [u8; 9]), Death> {
        // The order goes into the pipe while the runner is still stopped: continued, it finds the
        // order at once.
        if self.cmd.write_all(msg).and_then(|_| self.cmd.flush()).is_err() {
            return Err(self.wait_death());
        }
        let t = Instant::now();
        self.resume();
        // The runner stops itself right after its answer (runner_main): wait for that stop, so
        // whatever the kernel left running is frozen until the judge has read the outputs. The
        // clock runs until the stop is seen, not until an answer arrives: the candidate shares
        // the runner's process and can write an answer of its own long before it is done
        // (pointing the runner's descriptor elsewhere), but it cannot stop its process early
        // without leaving the work undone at the stop, or doing it in the next timed call.
        self.wait_stopped()?;
        let seen = t.elapsed().as_secs_f64();
        // The runner answered before it stopped: the answer is waiting, whole.
        let mut waiting: libc::c_int = 0;
        // SAFETY: FIONREAD on our end of the pipe, into a c_int.
        let r = unsafe { libc::ioctl(self.replies.as_raw_fd(), libc::FIONREAD, &mut waiting) };
        if r != 0 || waiting < 9 {
            self.kill();
            return Err(Death::Forged(format!(
                "the kernel stopped the runner before it answered ({} bytes on its answer channel)",
                waiting.max(0)
            )));
        }
        let mut b = [0u8; 9];
        if self.replies.read_exact(&mut b).is_err() {
            return Err(self.wait_death());
        }
        Ok((seen, b))
    }

    /// Stop every thread of the runner (so nothing it left running can still write) and run
    /// `f`. The runner stays stopped: only the next `run` continues it, so a call whose outputs
    /// were read looks, to the candidate, like any other (nothing runs between two calls).
    pub fn stopped<T>(&mut self, f: impl FnOnce(&mut Runner) -> T) -> Result<T, Death> {
        if !self.held {
            // SAFETY: signalling our own child.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGSTOP);
            }
            self.wait_stopped()?;
        }
        self.no_bytes_beyond_answers()?;
        Ok(f(self))
    }

    /// Stopped after its answer, the runner has nothing more to say: bytes still waiting on its
    /// answer channel were written by the candidate (a forged reply ahead of the real one, whose
    /// outputs were read before the work was done, or after).
    fn no_bytes_beyond_answers(&mut self) -> Result<(), Death> {
        let mut waiting: libc::c_int = 0;
        // SAFETY: FIONREAD on our end of the pipe, into a c_int.
        let r = unsafe { libc::ioctl(self.replies.as_raw_fd(), libc::FIONREAD, &mut waiting) };
        if r == 0 && waiting > 0 {
            self.kill();
            return Err(Death::Forged(format!(
                "the kernel wrote to the runner's answer channel (a forged reply: {waiting} bytes beyond its answers)"
            )));
        }
        Ok(())
    }

    /// Wait until the runner is stopped (it stopped itself, or was stopped); its death if it
    /// ended instead.
    fn wait_stopped(&mut self) -> Result<(), Death> {
        let pid = self.child.id() as libc::pid_t;
        let mut st = 0;
        loop {
            let r = wait4(pid, &mut st, libc::WUNTRACED, &mut self.peak_rss);
            if r == pid {
                break;
            }
            if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                return Err(Death::Exit(-1));
            }
        }
        if libc::WIFEXITED(st) || libc::WIFSIGNALED(st) {
            self.exited = Some(st);
            self.drain_stderr();
            return Err(self.death_of(st));
        }
        self.held = true;
        Ok(())
    }

    /// Let a stopped runner go on.
    fn resume(&mut self) {
        if self.held {
            // SAFETY: signalling our own child.
            unsafe {
                libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT);
            }
            self.held = false;
        }
    }

    fn death_of(&self, st: i32) -> Death {
        if libc::WIFSIGNALED(st) {
            let sig = libc::WTERMSIG(st);
            let fault = self
                .stderr
                .lock()
                .ok()
                .and_then(|s| {
                    s.lines()
                        .rev()
                        .find_map(|l| l.strip_prefix("ksearch-runner fault ").map(|x| x.trim().to_string()))
                })
                .and_then(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok());
            Death::Signal { sig, fault }
        } else {
            Death::Exit(libc::WEXITSTATUS(st))
        }
    }

    /// Wait for the runner to end (after its channel closed) and say how.
    pub fn wait_death(&mut self) -> Death {
        if let Some(st) = self.exited {
            return self.death_of(st);
        }
        let pid = self.child.id() as libc::pid_t;
        let mut st = 0;
        let deadline = Instant::now() + std::time::Duration::from_secs(2);
        loop {
            let r = wait4(pid, &mut st, libc::WNOHANG, &mut self.peak_rss);
            if r == pid && (libc::WIFEXITED(st) || libc::WIFSIGNALED(st)) {
                break;
            }
            if r < 0 || Instant::now() > deadline {
                self.kill();
                wait4(pid, &mut st, 0, &mut self.peak_rss);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        self.drain_stderr();
        self.exited = Some(st);
        self.death_of(st)
    }

    /// Let the stderr reader take the last lines of a runner that ended (its fault address among
    /// them): until the pipe closes, for a moment at most.
    fn drain_stderr(&self) {
        let deadline = Instant::now() + std::time::Duration::from_millis(200);
        while !self.stderr_closed.load(Ordering::Acquire) && Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    /// Which buffer a fault address falls next to: (slot, bytes past the payload end, or before
    /// the slot start when negative).
    pub fn locate_fault(&self, addr: u64) -> Option<(usize, i64)> {
        let base = self.arena_base;
        if addr < base || addr >= base + arena_len(&self.lens) as u64 {
            return None;
        }
        let off = (addr - base) as i64;
        // The nearest slot: the one whose end precedes the address, or whose start follows it.
        let mut best: Option<(usize, i64)> = None;
        for i in 0..self.lens.len() {
            let start = slot_position(&self.lens, i) as i64;
            let end = start + self.lens[i] as i64;
            let d = if off >= end {
                off - end
            } else if off < start {
                off - start
            } else {
                continue;
            };
            if best.is_none_or(|(_, b)| d.abs() < b.abs()) {
                best = Some((i, d));
            }
        }
        best
    }

    fn kill(&mut self) {
        let pid = self.child.id() as libc::pid_t;
        // SAFETY: the runner leads its own process group; kill the group, then the process.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.cmd.write_all(&0u64.to_le_bytes());
        self.kill();
        if self.exited.is_none() {
            let _ = self.child.wait();
        }
        // SAFETY: the mapping made in `start`, not used after this.
        unsafe {
            libc::munmap(self.shm as *mut libc::c_void, self.shm_len);
        }
    }
}

/// Start a runner that only sets up its sandbox and says what it achieved.
pub fn probe(exe: &Path) -> String {
    let out = Command::new(exe)
        .args([
            "runner",
            "--shm-fd",
            "-1",
            "--so-fd",
            "-1",
            "--slots",
            "",
            "--offsets",
            "",
            "--entries",
            "",
        ])
        .env_clear()
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output();
    match out {
        Ok(o) => {
            let s = String::from_utf8_lossy(&o.stdout);
            match s.lines().next().and_then(|l| l.strip_prefix("H ")) {
                Some(rest) => rest.split_once(' ').map(|x| x.1).unwrap_or("").trim().to_string(),
                None => "none (the runner did not start)".into(),
            }
        }
        Err(e) => format!("none (the runner did not start: {e})"),
    }
}

// ---------------------------------------------------------------------------------------------
// The runner side. Everything here runs in the untrusted process; nothing it says is believed.

fn parse_list(s: &str) -> Vec<usize> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .filter_map(|x| x.parse().ok())
        .collect()
}

#[cfg(target_os = "linux")]
static mut FAULT_MSG: [u8; 64] = [0; 64];

#[cfg(target_os = "linux")]
extern "C" fn on_fault(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: async-signal-safe: format into a static buffer and write(2) it; the handler was
    // installed with SA_RESETHAND, so returning re-raises the fault with the default action.
    unsafe {
        let addr = (*info).si_addr() as u64;
        let prefix = b"ksearch-runner fault 0x";
        let buf = &mut *std::ptr::addr_of_mut!(FAULT_MSG);
        buf[..prefix.len()].copy_from_slice(prefix);
        let mut n = prefix.len();
        for i in (0..16).rev() {
            let d = ((addr >> (i * 4)) & 0xF) as u8;
            buf[n] = if d < 10 { b'0' + d } else { b'a' + d - 10 };
            n += 1;
        }
        buf[n] = b'\n';
        libc::write(2, buf.as_ptr() as *const libc::c_void, n + 1);
    }
}

#[cfg(target_os = "linux")]
fn install_fault_handler() {
    // SAFETY: an alternate stack (leaked, lives for the process) and a handler for SIGSEGV and
    // SIGBUS that only writes and returns.
    unsafe {
        let size = 64 << 10;
        let stack = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if stack != libc::MAP_FAILED {
            let ss = libc::stack_t {
                ss_sp: stack,
                ss_flags: 0,
                ss_size: size,
            };
            libc::sigaltstack(&ss, std::ptr::null_mut());
        }
        for sig in [libc::SIGSEGV, libc::SIGBUS] {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_fault as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESETHAND;
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

#[cfg(target_os = "linux")]
fn seccomp(arena: u64, arena_len: u64) -> Result<(), String> {
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter, SeccompRule,
    };
    use std::collections::BTreeMap;
    let arch: seccompiler::TargetArch = std::env::consts::ARCH.try_into().map_err(|e| format!("{e:?}"))?;
    let me = std::process::id() as u64;
    let cond = |arg: u8, op: Op, v: u64| Cond::new(arg, Len::Qword, op, v).map_err(|e| e.to_string());
    let rule = |c: Vec<Cond>| SeccompRule::new(c).map_err(|e| e.to_string());
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let always = [
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_tkill,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_socket,
        libc::SYS_socketpair,
        libc::SYS_connect,
        libc::SYS_bind,
        libc::SYS_setsid,
        libc::SYS_setpgid,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_pidfd_open,
        libc::SYS_pidfd_send_signal,
        libc::SYS_pidfd_getfd,
        libc::SYS_kcmp,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_userfaultfd,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_reboot,
        libc::SYS_kexec_load,
        libc::SYS_setrlimit,
        libc::SYS_setuid,
        libc::SYS_setgid,
        libc::SYS_setreuid,
        libc::SYS_setregid,
        libc::SYS_setresuid,
        libc::SYS_setresgid,
        // Memory no limit counts, and System V objects that would outlive the runner (its
        // buffers were mapped before this filter; nothing of the runner uses these later).
        libc::SYS_memfd_create,
        libc::SYS_memfd_secret,
        libc::SYS_shmget,
        libc::SYS_shmat,
        libc::SYS_shmctl,
        libc::SYS_shmdt,
        libc::SYS_msgget,
        libc::SYS_msgsnd,
        libc::SYS_msgrcv,
        libc::SYS_msgctl,
        libc::SYS_semget,
        libc::SYS_semop,
        libc::SYS_semtimedop,
        libc::SYS_semctl,
        libc::SYS_mq_open,
        libc::SYS_mq_unlink,
        libc::SYS_mq_timedsend,
        libc::SYS_mq_timedreceive,
        libc::SYS_mq_notify,
        libc::SYS_mq_getsetattr,
    ];
    for s in always {
        deny.insert(s, vec![]);
    }
    #[cfg(target_arch = "x86_64")]
    for s in [libc::SYS_fork, libc::SYS_vfork] {
        deny.insert(s, vec![]);
    }
    // New processes: clone without CLONE_THREAD (threads stay allowed).
    deny.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(0, Op::MaskedEq(libc::CLONE_THREAD as u64), 0)?])?],
    );
    // Signals to anyone but itself.
    deny.insert(libc::SYS_kill, vec![rule(vec![cond(0, Op::Ne, me)?])?]);
    deny.insert(libc::SYS_tgkill, vec![rule(vec![cond(0, Op::Ne, me)?])?]);
    // Raising limits (reading them stays allowed: getrlimit is prlimit64 without a new value).
    deny.insert(libc::SYS_prlimit64, vec![rule(vec![cond(2, Op::Ne, 0)?])?]);
    // Keeping the parent-death signal.
    deny.insert(
        libc::SYS_prctl,
        vec![rule(vec![cond(0, Op::Eq, libc::PR_SET_PDEATHSIG as u64)?])?],
    );
    // Remapping or unprotecting the buffer arena (its guard pages).
    let in_arena = || -> Result<Vec<SeccompRule>, String> {
        Ok(vec![rule(vec![
            cond(0, Op::Ge, arena)?,
            cond(0, Op::Lt, arena + arena_len)?,
        ])?])
    };
    for s in [
        libc::SYS_mprotect,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_madvise,
        libc::SYS_pkey_mprotect,
    ] {
        deny.insert(s, in_arena()?);
    }
    // Mapping over the arena; and mappings the data-memory limit does not count: shared
    // anonymous memory (shmem, like a memfd's) and "stack" mappings (MAP_GROWSDOWN).
    let kind = (libc::MAP_SHARED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS) as u64;
    deny.insert(
        libc::SYS_mmap,
        vec![
            rule(vec![cond(0, Op::Ge, arena)?, cond(0, Op::Lt, arena + arena_len)?])?,
            rule(vec![cond(
                3,
                Op::MaskedEq(kind),
                (libc::MAP_SHARED | libc::MAP_ANONYMOUS) as u64,
            )?])?,
            rule(vec![cond(
                3,
                Op::MaskedEq(kind),
                (libc::MAP_SHARED_VALIDATE | libc::MAP_ANONYMOUS) as u64,
            )?])?,
            rule(vec![cond(
                3,
                Op::MaskedEq(libc::MAP_GROWSDOWN as u64),
                libc::MAP_GROWSDOWN as u64,
            )?])?,
        ],
    );
    let f = SeccompFilter::new(deny, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)
        .map_err(|e| e.to_string())?;
    let prog: seccompiler::BpfProgram = f.try_into().map_err(|e: seccompiler::BackendError| e.to_string())?;
    // clone3 hides its flags from seccomp: answer ENOSYS so the C library falls back to clone.
    let mut c3 = BTreeMap::new();
    c3.insert(libc::SYS_clone3, vec![]);
    let f3 = SeccompFilter::new(c3, SeccompAction::Allow, SeccompAction::Errno(libc::ENOSYS as u32), arch)
        .map_err(|e| e.to_string())?;
    let prog3: seccompiler::BpfProgram = f3.try_into().map_err(|e: seccompiler::BackendError| e.to_string())?;
    seccompiler::apply_filter(&prog3).map_err(|e| e.to_string())?;
    seccompiler::apply_filter(&prog).map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(target_os = "linux")]
fn landlock() -> Result<&'static str, String> {
    use landlock::{ABI, Access, AccessFs, Ruleset, RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope, path_beneath_rules};
    let abi = ABI::V6;
    let read = AccessFs::from_read(abi);
    // The C++ runtime of a compiler outside /usr is found through LD_LIBRARY_PATH.
    let extra: Vec<String> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|p| p.starts_with('/'))
        .map(String::from)
        .collect();
    let status = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))
        .map_err(|e| e.to_string())?
        .scope(Scope::from_all(abi))
        .map_err(|e| e.to_string())?
        .create()
        .map_err(|e| e.to_string())?
        .add_rules(path_beneath_rules(
            [
                "/usr",
                "/lib",
                "/lib64",
                "/etc/ld.so.cache",
                "/etc/ld.so.conf",
                "/etc/ld.so.conf.d",
                "/proc/self",
                "/sys/devices/system/cpu",
                "/dev/null",
                "/dev/urandom",
            ]
            .into_iter()
            .map(String::from)
            .chain(extra),
            read,
        ))
        .map_err(|e| e.to_string())?
        .restrict_self()
        .map_err(|e| e.to_string())?;
    Ok(match status.ruleset {
        RulesetStatus::FullyEnforced => "landlock",
        RulesetStatus::PartiallyEnforced => "landlock(partial)",
        RulesetStatus::NotEnforced => "",
    })
}

/// `ksearch runner …` off Linux: there is no sandbox to set up.
#[cfg(not(target_os = "linux"))]
pub fn runner_main(_shm_fd: RawFd, _so_fd: RawFd, _slots: &str, _offsets: &str, _entries: &str, _mem_limit: u64) -> i32 {
    println!("E the CPU back-end's sandboxed runner needs Linux");
    2
}

/// `ksearch runner …`: set up the sandbox, load the kernel, serve run commands. Returns the
/// exit code.
#[cfg(target_os = "linux")]
pub fn runner_main(shm_fd: RawFd, so_fd: RawFd, slots: &str, offsets: &str, entries: &str, mem_limit: u64) -> i32 {
    // A session and process group of its own (killed whole by the judge), the data-memory
    // limit, no core files, and death with the judge: all before any candidate code.
    // SAFETY: setsid, setrlimit, prctl and getppid act on this process only.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        if libc::getppid() == 1 {
            return 1;
        }
        libc::setsid();
        if mem_limit > 0 {
            let data = libc::rlimit {
                rlim_cur: mem_limit,
                rlim_max: mem_limit,
            };
            libc::setrlimit(libc::RLIMIT_DATA, &data);
        }
        let zero = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        libc::setrlimit(libc::RLIMIT_CORE, &zero);
    }
    // The reply channel is a copy of the original stdout; descriptor 1 then points at stderr, so
    // a kernel that prints cannot write into the channel by accident.
    // SAFETY: dup/dup2 of the process's own standard descriptors.
    let mut out = unsafe {
        let fd = libc::dup(1);
        if fd < 0 {
            return 3;
        }
        libc::dup2(2, 1);
        std::fs::File::from_raw_fd(fd)
    };
    let lens = parse_list(slots);
    let offs = parse_list(offsets);
    if lens.len() != offs.len() {
        let _ = writeln!(out, "E bad slot list");
        return 2;
    }
    let total = arena_len(&lens);
    // SAFETY: a fresh inaccessible reservation; slots are mapped over parts of it below.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        let _ = writeln!(out, "E cannot reserve the arena");
        return 2;
    }
    let base = base as *mut u8;
    for (i, (l, o)) in lens.iter().zip(&offs).enumerate() {
        // SAFETY: MAP_FIXED inside our own reservation, over the shared buffer file.
        let p = unsafe {
            libc::mmap(
                base.add(slot_position(&lens, i)) as *mut libc::c_void,
                *l,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                shm_fd,
                *o as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let _ = writeln!(out, "E cannot map buffer {i}: {}", std::io::Error::last_os_error());
            return 2;
        }
    }
    if shm_fd >= 0 {
        // SAFETY: the buffer file is mapped; its descriptor is not needed any more.
        unsafe { libc::close(shm_fd) };
    }
    // Nothing but the reply channel and the kernel is left open (whatever the worker may have
    // leaked to its children).
    let keep = [out.as_raw_fd(), so_fd];
    for fd in 3..4096 {
        if !keep.contains(&fd) {
            // SAFETY: closing descriptors this process does not use.
            unsafe { libc::close(fd) };
        }
    }
    install_fault_handler();

    // Isolation, strongest first; each step is optional.
    let mut levels: Vec<&str> = vec!["process group", "rlimits", "clean env"];
    // SAFETY: unshare/setgroups/setgid/setuid/prctl on this process only.
    unsafe {
        let root = libc::geteuid() == 0;
        let flags = if root {
            libc::CLONE_NEWNET
        } else {
            libc::CLONE_NEWUSER | libc::CLONE_NEWNET
        };
        // An IPC namespace of its own too: System V objects and POSIX message queues it could
        // make would outlive it (state carried to a later evaluation, memory no limit counts).
        if libc::unshare(flags | libc::CLONE_NEWIPC) == 0 {
            levels.push("netns");
            levels.push("ipcns");
        } else if libc::unshare(flags) == 0 {
            levels.push("netns");
        }
        if root {
            let nobody: libc::uid_t = 65534;
            if libc::setgroups(0, std::ptr::null()) == 0 && libc::setgid(nobody) == 0 && libc::setuid(nobody) == 0 {
                levels.push("unprivileged uid");
                // A user namespace of its own too, where the kernel lets an unprivileged user
                // make one: its threads are then counted apart from other runners' (below).
                libc::unshare(libc::CLONE_NEWUSER);
            }
        }
        // A bounded number of threads, so that a kernel's thread bomb fails in the kernel, not
        // in every process of the machine. Set after the user namespace is made: there the
        // count is of this runner's threads alone (without one, of all its user's processes).
        let mut nproc = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NPROC, &mut nproc) == 0 {
            let capped = libc::rlimit {
                rlim_cur: nproc.rlim_cur.min(MAX_THREADS),
                rlim_max: nproc.rlim_max.min(MAX_THREADS),
            };
            libc::setrlimit(libc::RLIMIT_NPROC, &capped);
        }
        // A change of credentials clears the parent-death signal: set it again.
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        libc::prctl(libc::PR_SET_DUMPABLE, 0);
        if libc::getppid() == 1 {
            return 1;
        }
    }
    match landlock() {
        Ok(l) if !l.is_empty() => levels.push(l),
        _ => {}
    }
    match seccomp(base as u64, total as u64) {
        Ok(()) => levels.push("seccomp"),
        Err(e) => eprintln!("seccomp not applied: {e}"),
    }
    if writeln!(out, "H {:x} {}", base as u64, levels.join("+"))
        .and_then(|_| out.flush())
        .is_err()
    {
        return 3;
    }

    if so_fd < 0 {
        return 0;
    }
    // Calibration round trips (calls with nothing to call, 1), then the order to load the
    // kernel (3): still trusted code.
    let mut input = std::io::stdin().lock();
    let mut ptrs: Vec<*mut u8> = Vec::new();
    let mut dims: Vec<i64> = Vec::new();
    loop {
        match read_word(&mut input) {
            Some(1) => {
                if let Err(code) = serve_call(&mut input, &mut out, &[], &lens, base, &mut ptrs, &mut dims) {
                    return code;
                }
            }
            Some(3) => break,
            _ => return 0,
        }
    }
    // Candidate code from here on (its static initialisers run at load).
    let path = format!("/proc/self/fd/{so_fd}");
    // SAFETY: loading untrusted code is this process's purpose; it is sandboxed above.
    let lib = match unsafe { libloading::Library::new(&path) } {
        Ok(l) => l,
        Err(e) => {
            let _ = writeln!(out, "E cannot load compiled kernel: {e}");
            return 2;
        }
    };
    let mut fns: Vec<Entry> = Vec::new();
    for e in entries.split(',').filter(|e| !e.is_empty()) {
        // SAFETY: the ABI of every entry point is fixed by the task format.
        match unsafe { lib.get::<Entry>(e.as_bytes()) } {
            Ok(f) => fns.push(*f),
            Err(_) => {
                let _ = writeln!(
                    out,
                    "E entry point `{e}` not found (declare it `extern \"C\" void {e}(void** bufs, const int64_t* dims)`)"
                );
                return 2;
            }
        }
    }
    if writeln!(out, "L").and_then(|_| out.flush()).is_err() {
        return 3;
    }
    loop {
        if read_word(&mut input) != Some(1) {
            return 0;
        }
        if let Err(code) = serve_call(&mut input, &mut out, &fns, &lens, base, &mut ptrs, &mut dims) {
            return code;
        }
    }
}

/// An entry point of the kernel.
#[cfg(target_os = "linux")]
type Entry = unsafe extern "C" fn(*mut *mut u8, *const i64);

#[cfg(target_os = "linux")]
fn read_word(input: &mut impl Read) -> Option<u64> {
    let mut word = [0u8; 8];
    input.read_exact(&mut word).ok()?;
    Some(u64::from_le_bytes(word))
}

/// One call (after its order word, 1): the buffers and dimensions of the order, every entry run
/// once, the answer (b'D' and the seconds the entries took), then a stop. Before the kernel is
/// loaded there is nothing to call: the judge's calibration takes the same path. The exit code
/// when the order is malformed or the channel gone.
#[cfg(target_os = "linux")]
fn serve_call(
    input: &mut impl Read,
    out: &mut std::fs::File,
    fns: &[Entry],
    lens: &[usize],
    base: *mut u8,
    ptrs: &mut Vec<*mut u8>,
    dims: &mut Vec<i64>,
) -> Result<(), i32> {
    let n = read_word(input).ok_or(3)?;
    ptrs.clear();
    for _ in 0..n {
        let (Some(slot), Some(off)) = (read_word(input), read_word(input)) else {
            return Err(3);
        };
        let slot = slot as usize;
        if slot >= lens.len() || off as usize >= lens[slot] {
            return Err(3);
        }
        // SAFETY: inside slot `slot` of the arena.
        ptrs.push(unsafe { base.add(slot_position(lens, slot) + off as usize) });
    }
    let nd = read_word(input).ok_or(3)?;
    dims.clear();
    for _ in 0..nd {
        dims.push(read_word(input).ok_or(3)? as i64);
    }
    let t = Instant::now();
    for f in fns {
        // SAFETY: untrusted candidate code, run here by design.
        unsafe { f(ptrs.as_mut_ptr(), dims.as_ptr()) };
    }
    let mut reply = [0u8; 9];
    reply[0] = b'D';
    reply[1..].copy_from_slice(&t.elapsed().as_secs_f64().to_le_bytes());
    if out.write_all(&reply).and_then(|_| out.flush()).is_err() {
        return Err(3);
    }
    // Stop every thread of this process at once, a system call after the answer, so that a
    // thread the kernel left running cannot finish its work before the judge looks: the judge's
    // clock ends at this stop, it reads the outputs while the runner is stopped, and continues it
    // only with the next call (`Runner::run`).
    // SAFETY: a signal to this process itself (the seccomp filter allows no other).
    unsafe {
        libc::kill(libc::getpid(), libc::SIGSTOP);
    }
    Ok(())
}
