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

/// End this process when the search process that started it is gone (re-parented), even while
/// a kernel hangs: no worker outlives its search. Its runner, if any, follows through its own
/// parent-death signal.
fn watch_parent() {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(std::time::Duration::from_millis(100));
            // SAFETY: as above; _exit ends the process at once.
            if unsafe { libc::getppid() } != parent {
                unsafe { libc::_exit(4) };
            }
        }
    });
}

/// Serve requests until stdin closes or a `shutdown` arrives. Returns the exit code.
pub fn serve(backend: &mut dyn Backend) -> i32 {
    watch_parent();
    let mut out = protocol_channel();
    let hello = Reply::Hello {
        backend: backend.name().to_string(),
        device: backend.device(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        kernels: None,
        isolation: backend.isolation(),
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
                        message: format!("the {} back-end has no native baseline", backend.name()),
                    },
                );
            }
            Request::Eval(req) => {
                let id = req.id;
                let reply = {
                    let mut progress = |stage: &str| {
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
