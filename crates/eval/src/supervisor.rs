//! The supervisor: spawns a worker process, sends it one request at a time, enforces a
//! wall-clock time-out per stage and a memory limit, and turns a dead or hung worker into a
//! classified failure. The search process never runs candidate code.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ksearch_core::protocol::{EvalReply, EvalRequest, FailureClass, Reply, Request};

use crate::common::signal_name;

/// Where and how a worker process is started. Workers speak JSON lines over their standard
/// input and output, so a launcher only has to carry those: the worker is the same program
/// either way.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Launcher {
    /// A child process of the search, on this machine.
    #[default]
    Local,
    /// One Slurm job step per worker: `srun --ntasks=1 --nodes=1 [--gres=gpu:1] ARGS -- worker…`
    /// (the GPU request for back-ends on a GPU). The worker program's path must exist on the
    /// node Slurm picks (a shared installation, or the same path everywhere).
    Slurm {
        /// The `srun` program.
        #[serde(default = "default_srun")]
        srun: String,
        /// Further `srun` arguments, e.g. `--partition=gpu`, `--time=2:00:00`.
        #[serde(default)]
        args: Vec<String>,
    },
}

fn default_srun() -> String {
    "srun".into()
}

impl Launcher {
    /// The launcher's name, as configured (`local`, `slurm`).
    pub fn name(&self) -> &'static str {
        match self {
            Launcher::Local => "local",
            Launcher::Slurm { .. } => "slurm",
        }
    }

    /// The program and arguments that start `spec` through this launcher. `gpu`: the worker
    /// needs a GPU of its own.
    pub fn command(&self, spec: &WorkerSpec, gpu: bool) -> (PathBuf, Vec<String>) {
        match self {
            Launcher::Local => (spec.program.clone(), spec.args.clone()),
            Launcher::Slurm { srun, args } => {
                let mut a = vec![
                    "--ntasks=1".to_string(),
                    "--nodes=1".into(),
                    "--job-name=ksearch-worker".into(),
                ];
                if gpu {
                    a.push("--gres=gpu:1".into());
                }
                a.extend(args.iter().cloned());
                a.push("--".into());
                a.push(spec.program.display().to_string());
                // Slurm hands the step the GPU it granted as CUDA_VISIBLE_DEVICES: inside it,
                // that GPU is device 0 whichever device the search counted it as.
                let mut device_next = false;
                for x in &spec.args {
                    a.push(if gpu && device_next { "0".into() } else { x.clone() });
                    device_next = x == "--device";
                }
                (PathBuf::from(srun), a)
            }
        }
    }
}

/// End a worker process (the launcher's process, for a launched one) and reap it.
fn end_worker(launcher: &Launcher, child: &mut Child) -> Option<std::process::ExitStatus> {
    if !matches!(launcher, Launcher::Local) {
        // The worker runs under the launcher's daemon, out of reach of a signal to the local
        // process group: ask the launcher to end its step (srun passes SIGTERM on to the
        // worker and ends the step, or withdraws a job still queued), then kill what is left
        // here. A worker whose launcher is gone anyway sees its request channel hang up and
        // ends itself.
        // SAFETY: a signal to our own child.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // SAFETY: the worker (or its launcher) leads its own process group: kill it whole.
    unsafe {
        libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL);
    }
    let _ = child.kill();
    child.wait().ok()
}

/// How to start a worker.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From request to "compiled".
    pub compile_timeout: Duration,
    /// Between two progress events once compiled (one workload).
    pub run_timeout: Duration,
    /// Resident memory the worker may reach.
    pub mem_limit_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            compile_timeout: Duration::from_secs(120),
            run_timeout: Duration::from_secs(60),
            mem_limit_bytes: 8 << 30,
        }
    }
}

struct Running {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<String>>>,
}

pub struct Supervisor {
    spec: WorkerSpec,
    launcher: Launcher,
    /// The worker needs a GPU of its own (a launcher requests one).
    gpu: bool,
    limits: Limits,
    worker: Option<Running>,
    /// Workers started so far (1 + restarts).
    pub starts: u32,
    pub device: String,
    pub backend: String,
    /// What the worker's hello said about running kernels (`None`: it did not say).
    pub kernels: Option<bool>,
    /// How the worker contains candidate code, as its hello said.
    pub isolation: Option<String>,
    /// Which clock times candidate calls, as its hello said.
    pub clock: Option<String>,
    scrubber: crate::scrub::Scrubber,
}

fn rss_bytes(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl Supervisor {
    pub fn new(spec: WorkerSpec, limits: Limits) -> Supervisor {
        Supervisor {
            spec,
            launcher: Launcher::Local,
            gpu: false,
            limits,
            worker: None,
            starts: 0,
            device: String::new(),
            backend: String::new(),
            kernels: None,
            isolation: None,
            clock: None,
            scrubber: crate::scrub::Scrubber::from_env(&[]),
        }
    }

    /// Start the worker through `launcher` (`gpu`: it needs a GPU of its own).
    pub fn launched_by(mut self, launcher: Launcher, gpu: bool) -> Supervisor {
        self.launcher = launcher;
        self.gpu = gpu;
        self
    }

    /// How the worker is started.
    pub fn launcher(&self) -> &Launcher {
        &self.launcher
    }

    /// Also scrub the values of these variables (configured key variables) from replies.
    pub fn scrub_also(&mut self, names: &[String]) {
        self.scrubber = crate::scrub::Scrubber::from_env(names);
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    fn spawn(&mut self) -> Result<(), String> {
        let (program, args) = self.launcher.command(&self.spec, self.gpu);
        let mut cmd = Command::new(&program);
        // The worker sees only the allow-listed environment (never a key) and leads a process
        // group of its own so it can be killed whole. (It watches its parent itself, see
        // `worker::serve`: a parent-death signal would fire when the *thread* that started it
        // ends, and workers are restarted from the pool's short-lived threads.)
        // A launcher's own variables (Slurm's) reach the launcher; it passes them on to the
        // worker, which is harmless: none is a secret.
        // A variable that holds a secret never passes, whatever its name: the configured key
        // variables (`scrub_also`) are secrets even when their names pass the allow-list.
        let clean = |vars: Vec<(String, String)>| -> Vec<(String, String)> {
            vars.into_iter().filter(|(_, v)| self.scrubber.text(v) == *v).collect()
        };
        cmd.args(&args)
            .env_clear()
            .envs(clean(crate::scrub::worker_env()))
            .envs(clean(crate::scrub::launcher_env(&self.launcher)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &self.spec.env {
            cmd.env(k, v);
        }
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::setpgid(0, 0);
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| match self.launcher {
            Launcher::Local => format!("cannot start worker {}: {e}", program.display()),
            _ => format!(
                "cannot start worker through {} ({}): {e}",
                self.launcher.name(),
                program.display()
            ),
        })?;
        let stdin = child.stdin.take().ok_or("worker has no stdin")?;
        let stdout = child.stdout.take().ok_or("worker has no stdout")?;
        let stderr = child.stderr.take().ok_or("worker has no stderr")?;
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Err(_) => break,
                }
            }
        });
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Ok(mut v) = log2.lock() {
                    v.push(line);
                    if v.len() > 200 {
                        v.drain(..100);
                    }
                }
            }
        });
        self.starts += 1;
        let mut w = Running {
            child,
            stdin,
            lines: rx,
            stderr: log,
        };
        // The worker greets first.
        let deadline = Instant::now() + self.limits.compile_timeout;
        loop {
            match w.lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(l) => {
                    if let Ok(Reply::Hello {
                        backend,
                        device,
                        kernels,
                        isolation,
                        clock,
                        ..
                    }) = serde_json::from_str::<Reply>(&l)
                    {
                        self.backend = backend;
                        self.device = self.scrubber.text(&device);
                        self.kernels = kernels;
                        self.isolation = isolation;
                        self.clock = clock;
                        break;
                    }
                }
                Err(_) => {
                    let exited = matches!(w.child.try_wait(), Ok(Some(_)));
                    end_worker(&self.launcher, &mut w.child);
                    std::thread::sleep(Duration::from_millis(20));
                    let err = w.stderr.lock().map(|v| v.join("\n")).unwrap_or_default();
                    let tail = last_lines(&err, 5);
                    let why = if !tail.is_empty() {
                        tail
                    } else if exited {
                        "it exited without a word".to_string()
                    } else if let Launcher::Slurm { .. } = self.launcher {
                        format!(
                            "no greeting within {:.1} s (the compile time-out, which also bounds the wait in \
                             Slurm's queue: was the job still pending? see squeue)",
                            self.limits.compile_timeout.as_secs_f64()
                        )
                    } else {
                        format!(
                            "no greeting within {:.1} s (the compile time-out; is it too short?)",
                            self.limits.compile_timeout.as_secs_f64()
                        )
                    };
                    return Err(self.scrubber.text(&format!("worker did not start: {why}")));
                }
            }
        }
        self.worker = Some(w);
        Ok(())
    }

    /// Start the worker if needed and return its device description.
    pub fn start(&mut self) -> Result<String, String> {
        if self.worker.is_none() {
            self.spawn()?;
        }
        Ok(self.device.clone())
    }

    fn kill(&mut self) -> Option<std::process::ExitStatus> {
        let mut w = self.worker.take()?;
        end_worker(&self.launcher, &mut w.child)
    }

    fn stderr_tail(&self) -> String {
        self.worker
            .as_ref()
            .and_then(|w| w.stderr.lock().ok().map(|v| last_lines(&v.join("\n"), 8)))
            .unwrap_or_default()
    }

    /// Evaluate one request. Never panics and never returns without a reply: a worker that
    /// dies, hangs or grows past the memory limit yields a classified failure, and the next
    /// call starts a fresh worker.
    pub fn eval(&mut self, req: &EvalRequest) -> EvalReply {
        let mut r = self.exchange(Request::Eval(Box::new(req.clone())), req);
        self.scrubber.reply(&mut r);
        r
    }

    /// Time the back-end's native implementation on `req`'s workloads (see
    /// `Request::Baseline`), with the same limits and failure handling as `eval`.
    pub fn baseline(&mut self, req: &EvalRequest) -> EvalReply {
        let mut r = self.exchange(Request::Baseline(Box::new(req.clone())), req);
        self.scrubber.reply(&mut r);
        r
    }

    fn exchange(&mut self, msg: Request, req: &EvalRequest) -> EvalReply {
        // A worker that exited on its own (e.g. after a device fault) is replaced first.
        if let Some(w) = self.worker.as_mut()
            && matches!(w.child.try_wait(), Ok(Some(_)))
        {
            self.worker = None;
        }
        if let Err(e) = self.start() {
            return EvalReply::failed(req.id, FailureClass::Infra, e);
        }
        let line = match serde_json::to_string(&msg) {
            Ok(l) => l,
            Err(e) => return EvalReply::failed(req.id, FailureClass::Infra, format!("cannot encode request: {e}")),
        };
        let w = self.worker.as_mut().expect("started above");
        if writeln!(w.stdin, "{line}").and_then(|_| w.stdin.flush()).is_err() {
            let st = self.kill();
            return EvalReply::failed(
                req.id,
                FailureClass::Infra,
                format!("worker exited before the request ({st:?})"),
            );
        }
        let pid = w.child.id();
        let mut deadline = Instant::now() + self.limits.compile_timeout;
        let mut stage = "compile".to_string();
        let mut peak_rss = 0u64;
        loop {
            let w = self.worker.as_mut().expect("worker present while waiting");
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(20));
            match w.lines.recv_timeout(wait) {
                Ok(l) => match serde_json::from_str::<Reply>(&l) {
                    Ok(Reply::Eval(r)) if r.id == req.id => return *r,
                    Ok(Reply::Progress { id, stage: s }) if id == req.id => {
                        stage = s;
                        deadline = Instant::now() + self.limits.run_timeout;
                    }
                    Ok(Reply::Error { message }) => {
                        return EvalReply::failed(req.id, FailureClass::Infra, format!("worker refused the request: {message}"));
                    }
                    Ok(_) => {}
                    Err(e) => {
                        self.kill();
                        let head: String = l.chars().take(200).collect();
                        return EvalReply::failed(req.id, FailureClass::Infra, format!("unreadable worker reply ({e}): {head}"));
                    }
                },
                Err(RecvTimeoutError::Timeout) => {
                    // A launched worker's memory is out of sight here (`pid` is its launcher):
                    // the launcher limits it (e.g. srun --mem).
                    let local = matches!(self.launcher, Launcher::Local);
                    if let Some(rss) = rss_bytes(pid).filter(|_| local) {
                        peak_rss = peak_rss.max(rss);
                        if rss > self.limits.mem_limit_bytes {
                            self.kill();
                            return EvalReply::failed(
                                req.id,
                                FailureClass::OutOfMemory,
                                format!(
                                    "worker memory reached {} MiB (limit {} MiB) while {}; worker killed",
                                    rss >> 20,
                                    self.limits.mem_limit_bytes >> 20,
                                    stage_words(&stage)
                                ),
                            );
                        }
                    }
                    if Instant::now() >= deadline {
                        let limit = if stage == "compile" {
                            self.limits.compile_timeout
                        } else {
                            self.limits.run_timeout
                        };
                        self.kill();
                        let what = stage_words(&stage);
                        return EvalReply::failed(
                            req.id,
                            FailureClass::Timeout,
                            format!("no answer within {:.1} s while {what}; worker killed", limit.as_secs_f64()),
                        );
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Give the stderr reader a moment to drain the last lines.
                    std::thread::sleep(Duration::from_millis(50));
                    let tail = self.stderr_tail();
                    let st = self.kill();
                    let near_limit = peak_rss as f64 > 0.8 * self.limits.mem_limit_bytes as f64;
                    use std::os::unix::process::ExitStatusExt;
                    let (class, why) = match st.and_then(|s| s.signal()) {
                        Some(sig) if near_limit => (
                            FailureClass::OutOfMemory,
                            format!("killed by {} near the memory limit", signal_name(sig)),
                        ),
                        Some(sig) => (
                            FailureClass::Crash,
                            format!("worker killed by {} ({sig}) while {}", signal_name(sig), stage_words(&stage)),
                        ),
                        None => {
                            let code = st.and_then(|s| s.code()).unwrap_or(-1);
                            let lower = tail.to_lowercase();
                            if lower.contains("out of memory") || lower.contains("bad_alloc") {
                                (
                                    FailureClass::OutOfMemory,
                                    format!("worker ran out of memory while {} (exit {code})", stage_words(&stage)),
                                )
                            } else {
                                (
                                    FailureClass::Crash,
                                    format!("worker exited with code {code} while {}", stage_words(&stage)),
                                )
                            }
                        }
                    };
                    let msg = if tail.is_empty() {
                        why
                    } else {
                        format!("{why}; stderr: {tail}")
                    };
                    return EvalReply::failed(req.id, class, msg);
                }
            }
        }
    }

    pub fn shutdown(&mut self) {
        if let Some(mut w) = self.worker.take() {
            let _ = writeln!(w.stdin, "{}", serde_json::to_string(&Request::Shutdown).unwrap_or_default());
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = w.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            end_worker(&self.launcher, &mut w.child);
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn stage_words(stage: &str) -> String {
    match stage {
        "compile" => "compiling".into(),
        "compiled" => "running the first workload".into(),
        s => format!("running (after {s})"),
    }
}

fn last_lines(s: &str, n: usize) -> String {
    // Blank lines say nothing: a tail of them is no reason.
    let v: Vec<&str> = s.lines().map(str::trim_end).filter(|l| !l.trim().is_empty()).collect();
    v[v.len().saturating_sub(n)..].join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Through Slurm a worker is one srun task on one node, with a GPU of its own where it
    /// needs one (then device 0 of its step); locally it is the program itself.
    #[test]
    fn launchers_wrap_the_worker_command() {
        let spec = WorkerSpec {
            program: "/opt/ksearch".into(),
            args: ["worker", "--backend", "cuda", "--device", "3"].map(String::from).to_vec(),
            env: vec![],
        };
        assert_eq!(
            Launcher::Local.command(&spec, true),
            ("/opt/ksearch".into(), spec.args.clone())
        );
        let slurm = Launcher::Slurm {
            srun: "/usr/bin/srun".into(),
            args: vec!["--partition=gpu".into()],
        };
        let (p, a) = slurm.command(&spec, true);
        assert_eq!(p, PathBuf::from("/usr/bin/srun"));
        assert_eq!(
            a.join(" "),
            "--ntasks=1 --nodes=1 --job-name=ksearch-worker --gres=gpu:1 --partition=gpu -- /opt/ksearch worker --backend cuda --device 0"
        );
        let (_, a) = slurm.command(&spec, false);
        assert!(!a.iter().any(|x| x.starts_with("--gres")) && a.ends_with(&["--device".into(), "3".into()]));
        // The configuration's spelling.
        let l: Launcher = serde_json::from_str(r#"{"kind":"slurm"}"#).unwrap();
        assert_eq!(
            l,
            Launcher::Slurm {
                srun: "srun".into(),
                args: vec![]
            }
        );
    }

    /// A launcher that cannot be started is one line naming it.
    #[test]
    fn a_missing_launcher_is_named() {
        let mut s = Supervisor::new(
            WorkerSpec {
                program: "/bin/true".into(),
                args: vec![],
                env: vec![],
            },
            Limits::default(),
        )
        .launched_by(
            Launcher::Slurm {
                srun: "/nonexistent/srun".into(),
                args: vec![],
            },
            false,
        );
        let e = s.start().unwrap_err();
        assert!(
            e.starts_with("cannot start worker through slurm (/nonexistent/srun): "),
            "{e}"
        );
        assert!(!e.contains('\n'));
    }

    /// A worker sees no key: the environment it starts with is the allow-list only.
    #[test]
    fn workers_start_without_secrets() {
        // SAFETY: this test is the only one in this binary touching these variables.
        unsafe {
            std::env::set_var("ZZ_CANARY_TOKEN", "sk-canary-secret-value-1234");
            std::env::set_var("ZZ_UNLISTED_SETTING", "unlistedvalue123456");
            // A configured key variable whose name the allow-list would pass, and a plain one.
            std::env::set_var("KSEARCH_ZZ_LLM", "sk-configured-Value-0987654321");
            std::env::set_var("KSEARCH_ZZ_PLAIN", "plain");
        }
        let script = r#"printf '{"reply":"hello","backend":"t","device":"%s,%s","pid":1,"version":"0"}\n' "$(env | grep -v KSEARCH_ZZ_PLAIN | grep -c ZZ_)" "$(env | grep -c KSEARCH_ZZ_PLAIN=plain)"; read x"#;
        let mut s = Supervisor::new(
            WorkerSpec {
                program: "/bin/sh".into(),
                args: vec!["-c".into(), script.into()],
                env: vec![],
            },
            Limits::default(),
        );
        s.scrub_also(&["KSEARCH_ZZ_LLM".to_string()]);
        assert_eq!(
            s.start().unwrap(),
            "0,1",
            "variables outside the allow-list, or holding a configured key, reached the worker (or the plain one did not)"
        );
        // And what comes back is scrubbed of them.
        let r = EvalReply::failed(
            1,
            FailureClass::Crash,
            "leaked sk-canary-secret-value-1234 and unlistedvalue123456",
        );
        let mut r2 = r.clone();
        s.scrubber.reply(&mut r2);
        assert_eq!(r2.failure.unwrap().message, "leaked [redacted] and [redacted]");
        s.shutdown();
    }
}
