//! The worker loop: read requests from stdin, answer on the protocol channel.
//!
//! The protocol channel is the process's original stdout. Before any candidate runs, file
//! descriptor 1 is pointed at stderr, so a kernel that prints cannot corrupt the protocol.

use std::io::{BufRead, Write};
use std::os::fd::FromRawFd;

use ksearch_core::protocol::{Reply, Request};

use crate::Backend;

fn protocol_channel() -> std::fs::File {
    // SAFETY: dup/dup2 on the process's own standard descriptors; the duplicate is owned by
    // the returned File and nothing else closes it. Close-on-exec: no child (compiler, runner)
    // inherits the protocol channel.
    unsafe {
        let fd = libc::fcntl(1, libc::F_DUPFD_CLOEXEC, 3);
        if fd < 0 {
            return std::fs::File::from_raw_fd(1);
        }
        libc::dup2(2, 1);
        std::fs::File::from_raw_fd(fd)
    }
}

fn send(out: &mut std::fs::File, r: &Reply) -> bool {
    match serde_json::to_string(r) {
        Ok(mut s) => {
            s.push('\n');
            out.write_all(s.as_bytes()).and_then(|_| out.flush()).is_ok()
        }
        Err(_) => false,
    }
}

/// End this process, and every process of its group, as soon as the search that started it is
/// gone, even while a kernel hangs or a device call never returns: no worker outlives its
/// search. Two signs, watched by one thread that sleeps in `poll` between them: the request
/// channel (stdin) hangs up, which is what a worker started through a launcher such as `srun`
/// sees (its parent is the launcher's daemon, not the search); or this process is re-parented.
/// The worker's own children (a compiler) go with its process group when it leads one; its
/// runner, in a session of its own, follows through its parent-death signal.
fn watch_parent() {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    std::thread::spawn(move || {
        #[cfg(target_os = "linux")]
        let hangup_events = libc::POLLRDHUP;
        #[cfg(not(target_os = "linux"))]
        let hangup_events = 0;
        let mut watch_stdin = true;
        loop {
            let mut fd = libc::pollfd {
                fd: if watch_stdin { 0 } else { -1 },
                events: hangup_events,
                revents: 0,
            };
            // SAFETY: one valid pollfd; a negative fd is ignored by poll (a plain sleep).
            let n = unsafe { libc::poll(&mut fd, 1, 100) };
            let hung_up = n > 0 && fd.revents & (libc::POLLHUP | libc::POLLERR | hangup_events) != 0;
            if n > 0 && fd.revents & libc::POLLNVAL != 0 {
                // No stdin to watch (closed at start): the parent alone tells.
                watch_stdin = false;
            }
            // SAFETY: as above.
            if hung_up || unsafe { libc::getppid() } != parent {
                // SAFETY: signals to this process's own group only when it leads one (else
                // the group is someone else's); _exit ends the process at once.
                unsafe {
                    if libc::getpgrp() == libc::getpid() {
                        libc::kill(0, libc::SIGKILL);
                    }
                    libc::_exit(4);
                }
            }
        }
    });
}

/// What the worker says about its containment, plus the Slurm job step it runs in when a
/// launcher started it through `srun` (the search keeps Slurm's variables from workers it
/// starts itself), so a run's header shows where its workers ran.
fn with_launch(isolation: Option<String>) -> Option<String> {
    let Ok(job) = std::env::var("SLURM_JOB_ID") else {
        return isolation;
    };
    let step = std::env::var("SLURM_STEP_ID").unwrap_or_else(|_| "?".into());
    let node = std::env::var("SLURMD_NODENAME").unwrap_or_else(|_| "?".into());
    let slurm = format!("Slurm job {job} step {step} on {node}");
    Some(match isolation {
        Some(i) if !i.is_empty() => format!("{i}; {slurm}"),
        _ => slurm,
    })
}

/// Serve requests until stdin closes or a `shutdown` arrives. Returns the exit code.
pub fn serve(backend: &mut dyn Backend) -> i32 {
    watch_parent();
    let mut out = protocol_channel();
    let hello = Reply::Hello {
        backend: backend.backend().name().to_string(),
        device: backend.device(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        kernels: None,
        isolation: with_launch(backend.isolation()),
        clock: backend.clock(),
    };
    if !send(&mut out, &hello) {
        return 3;
    }
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { return 3 };
        if line.trim().is_empty() {
            continue;
        }
        let req: Request = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                send(
                    &mut out,
                    &Reply::Error {
                        message: format!("bad request: {e}"),
                    },
                );
                continue;
            }
        };
        match req {
            Request::Shutdown => return 0,
            Request::Hello => {
                send(&mut out, &hello);
            }
            Request::Baseline(_) => {
                send(
                    &mut out,
                    &Reply::Error {
                        message: format!("the {} back-end has no native baseline", backend.backend()),
                    },
                );
            }
            Request::Eval(req) => {
                let id = req.id;
                let arrived = std::time::Instant::now();
                let mut compiled_after: Option<f64> = None;
                let mut reply = {
                    let mut progress = |stage: &str| {
                        if stage == "compiled" && compiled_after.is_none() {
                            compiled_after = Some(arrived.elapsed().as_secs_f64());
                        }
                        send(
                            &mut out_clone(&out),
                            &Reply::Progress {
                                id,
                                stage: stage.to_string(),
                            },
                        );
                    };
                    backend.eval(&req, &mut progress)
                };
                // Compile time as the worker saw it: from the request to a loaded candidate
                // (the whole request when it never got that far).
                if reply.compile_s == 0.0 {
                    reply.compile_s = compiled_after.unwrap_or_else(|| arrived.elapsed().as_secs_f64());
                }
                if !send(&mut out, &Reply::Eval(Box::new(reply))) {
                    return 3;
                }
            }
        }
    }
    0
}

fn out_clone(f: &std::fs::File) -> std::fs::File {
    f.try_clone().unwrap_or_else(|_| {
        // SAFETY: fall back to fd 2 (stderr) which is always open in a worker.
        unsafe { std::fs::File::from_raw_fd(libc::dup(2)) }
    })
}
