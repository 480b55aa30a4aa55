//! The Metal executor: a Metal source compiled with the shim in its execution mode
//! (`kb/metal-shim/metal_stdlib.h`, `KS_METAL_EXEC`) and a driver that runs every launch's
//! threadgroups as fibers over the buffers, in a child process confined once its buffers are
//! loaded. MLX bodies ([`metal_run`]) and whole Metal files ([`metal_run_file`]).

use std::collections::BTreeMap;
use std::process::Command;

use crate::metal::{BodySig, MLX_ATTRS, diagnostics, find_cxx, metal_type, rewrite, shim_dir, shim_text, write};

/// One launch of an emulated run: the kernel (`// @kernel` entry, or the body of a file without
/// sections), MLX's grid (threads) and threadgroup.
#[derive(Debug, Clone, PartialEq)]
pub struct EmuLaunch {
    pub entry: String,
    pub grid: [u32; 3],
    pub threadgroup: [u32; 3],
}

/// A buffer of an emulated run: task tensors and scratch, by the names the bodies use; `shape`
/// is what the body sees as `<name>_shape`. Outputs and scratch come back in `bytes`.
#[derive(Debug, Clone, PartialEq)]
pub struct EmuBuffer {
    pub name: String,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Threadgroup storage declared in a body (`threadgroup float buf[N];`) becomes one object per
/// threadgroup in the executor's arena; pointers (`threadgroup float* p`) only lose the word.
/// Lines are kept.
fn threadgroup_storage(src: &str, first_id: usize) -> String {
    let decl = crate::cached_regex(
        r"(?m)^([ \t]*)threadgroup[ \t]+([A-Za-z_][\w:<>, ]*?)[ \t]+([A-Za-z_]\w*)[ \t]*((?:\[[^\]\n]+\][ \t]*)*);",
    );
    let mut n = first_id;
    decl.replace_all(src, |c: &regex::Captures| {
        n += 1;
        let dims: String = c[4].split_whitespace().collect();
        format!("{}auto& {} = *ks::tg_alloc<{}{}>({n});", &c[1], &c[3], c[2].trim(), dims)
    })
    .into_owned()
}

/// Run a Metal source (an MLX body file, `sig` giving its buffers and template constants) on the
/// CPU with the shim's executor: every launch in order over `buffers`, each threadgroup's
/// threads as fibers (see `kb/metal-shim/metal_stdlib.h`). Outputs and scratch are read back
/// into `buffers`. The process has a time limit, a 16 GiB address space and, on Linux, a seccomp
/// filter from the moment its buffers are loaded (`LOCKDOWN`).
/// `Err`: the compiler's diagnostics, the executor's one-line reason
/// (threadgroup memory over 32 KB, a memory fault past a buffer's end or in a thread's stack) or
/// the time limit.
pub fn metal_run(
    src: &str,
    sig: &BodySig,
    launches: &[EmuLaunch],
    buffers: &mut [EmuBuffer],
    limit: std::time::Duration,
) -> Result<(), String> {
    let sectioned = ksearch_core::mlx::has_sections(src);
    let mut sig = sig.clone();
    sig.header = threadgroup_storage(&sig.header, 1_000_000);
    let (text, _) = shim_text(&threadgroup_storage(src, 0), Some(&sig));
    let mut calls = Vec::new();
    for l in launches {
        calls.push(body_call(&sig, sectioned, l, buffers)?);
    }
    execute(&text, &calls, launches, buffers, limit)
}

/// Run a whole Metal file (one `[[kernel]]` function with `[[buffer(i)]]` parameters) like
/// [`metal_run`]: pointer parameters are bound to the buffers of the same name, `constant T&`
/// parameters to `scalars` of the same name, position parameters to the threads' positions.
pub fn metal_run_file(
    src: &str,
    launch: &EmuLaunch,
    buffers: &mut [EmuBuffer],
    scalars: &BTreeMap<String, i64>,
    limit: std::time::Duration,
) -> Result<(), String> {
    let (name, params) = kernel_signature(src)?;
    let mut decls = String::new();
    let mut args = Vec::new();
    for (i, p) in params.iter().enumerate() {
        args.push(match &p.attr {
            ParamAttr::Buffer if p.ty.contains('*') => {
                let b = buffers
                    .iter()
                    .position(|b| b.name == p.name)
                    .ok_or_else(|| format!("kernel parameter `{}` ({}) matches no tensor of the task", p.name, p.ty))?;
                format!("({})ks_buf[{b}]", p.ty)
            }
            ParamAttr::Buffer => {
                let v = scalars
                    .get(&p.name)
                    .ok_or_else(|| format!("kernel parameter `{}` ({}) matches no axis of the task", p.name, p.ty))?;
                let t = p.ty.replace('&', "");
                decls.push_str(&format!("static {t} ks_scalar{i} = {v};\n"));
                format!("ks_scalar{i}")
            }
            ParamAttr::Builtin(b) => {
                let width = BUILTINS.iter().find(|(n, _)| n == b).map(|(_, w)| *w).ok_or_else(|| {
                    format!(
                        "kernel parameter `{}`: attribute [[{b}]] is not modelled by the executor",
                        p.name
                    )
                })?;
                let t = p.ty.trim();
                let comps = t.chars().last().and_then(|c| c.to_digit(10)).unwrap_or(1);
                match (width, comps) {
                    (1, 1) => format!("{t}({b})"),
                    (3, 1) => format!("{t}({b}.x)"),
                    (3, 2) => format!("{t}({b}.x, {b}.y)"),
                    (3, 3) => format!("{t}({b}.x, {b}.y, {b}.z)"),
                    _ => return Err(format!("kernel parameter `{}`: type `{t}` for [[{b}]]", p.name)),
                }
            }
            ParamAttr::Other(a) => {
                return Err(format!(
                    "kernel parameter `{}`: attribute [[{a}]] is not modelled by the executor",
                    p.name
                ));
            }
        });
    }
    let text = format!(
        "#include <metal_stdlib>\n#line 1 \"source.metal\"\n{}\n#line 1 \"bindings.cpp\"\nnamespace {{\nextern void* ks_buf[];\n{decls}}}\n",
        threadgroup_storage(&rewrite(src), 0)
    );
    execute(
        &text,
        &[format!("{name}({})", args.join(", "))],
        std::slice::from_ref(launch),
        buffers,
        limit,
    )
}

/// The position attributes the executor provides: name, components (1 or 3).
const BUILTINS: &[(&str, u32)] = &[
    ("thread_position_in_grid", 3),
    ("threads_per_grid", 3),
    ("thread_position_in_threadgroup", 3),
    ("threads_per_threadgroup", 3),
    ("threadgroup_position_in_grid", 3),
    ("threadgroups_per_grid", 3),
    ("dispatch_threads_per_threadgroup", 3),
    ("thread_index_in_threadgroup", 1),
    ("thread_index_in_simdgroup", 1),
    ("simdgroup_index_in_threadgroup", 1),
    ("simdgroups_per_threadgroup", 1),
    ("threads_per_simdgroup", 1),
    ("thread_execution_width", 1),
];

enum ParamAttr {
    Buffer,
    Builtin(String),
    Other(String),
}

struct Param {
    ty: String,
    name: String,
    attr: ParamAttr,
}

/// The kernel function of a whole Metal file: its name and parameters (type, name, attribute).
fn kernel_signature(src: &str) -> Result<(String, Vec<Param>), String> {
    let head = crate::cached_regex(r"(?s)(?:\[\[\s*kernel[^\]]*\]\]|\bkernel)\s+void\s+([A-Za-z_]\w*)\s*\(");
    let m = head
        .captures(src)
        .ok_or("no kernel function found (`[[kernel]] void name(...)` or `kernel void name(...)`)")?;
    let name = m[1].to_string();
    let start = m.get(0).map(|x| x.end()).unwrap_or(0);
    let (mut depth, mut end) = (1, None);
    for (i, ch) in src[start..].char_indices() {
        match ch {
            '(' | '[' => depth += 1,
            ')' | ']' => {
                depth -= 1;
                if depth == 0 {
                    end = Some(start + i);
                    break;
                }
            }
            _ => {}
        }
    }
    let list = &src[start..end.ok_or("the kernel's parameter list is not closed")?];
    let (mut parts, mut cur, mut d) = (Vec::new(), String::new(), 0);
    for ch in list.chars() {
        match ch {
            '(' | '[' | '<' => d += 1,
            ')' | ']' | '>' => d -= 1,
            ',' if d == 0 => {
                parts.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    parts.push(cur);
    let param = crate::cached_regex(r"(?s)^\s*(.*?)\b([A-Za-z_]\w*)\s*\[\[\s*([A-Za-z_]\w*)\s*(?:\(([^)]*)\))?\s*\]\]\s*$");
    let mut out = Vec::new();
    for p in parts.iter().filter(|p| !p.trim().is_empty()) {
        let c = param
            .captures(p)
            .ok_or_else(|| format!("kernel parameter `{}`: expected `type name [[attribute]]`", p.trim()))?;
        let attr = match &c[3] {
            "buffer" => ParamAttr::Buffer,
            a if BUILTINS.iter().any(|(n, _)| *n == a) => ParamAttr::Builtin(a.to_string()),
            a => ParamAttr::Other(a.to_string()),
        };
        out.push(Param {
            ty: c[1].split_whitespace().collect::<Vec<_>>().join(" "),
            name: c[2].to_string(),
            attr,
        });
    }
    Ok((name, out))
}

/// Compile `text` (the shim's execution mode) with a driver that runs `calls[j]` for every thread
/// of launch j, and run it on `buffers`.
fn execute(
    text: &str,
    calls: &[String],
    launches: &[EmuLaunch],
    buffers: &mut [EmuBuffer],
    limit: std::time::Duration,
) -> Result<(), String> {
    let cxx = find_cxx().ok_or_else(|| "no C++ compiler found (install clang++ or g++, or set KSEARCH_CXX)".to_string())?;
    let dir = shim_dir()?;
    let mut prog = format!("#define KS_METAL_EXEC 1\n{text}\n#line 1 \"driver.cpp\"\n");
    prog.push_str(&driver(calls, launches, buffers)?);
    let file = dir.path().join("run.cpp");
    write(&file, &prog)?;
    let exe = dir.path().join("run");
    let out = Command::new(&cxx)
        .env_clear()
        .envs(plain_env())
        .args(["-std=c++17", "-O1", "-w", "-x", "c++", "-I"])
        .arg(dir.path().join("shim"))
        .arg(&file)
        .arg("-o")
        .arg(&exe)
        .current_dir(dir.path())
        .output()
        .map_err(|e| format!("{cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} (Metal shim, execution) rejected the source:\n{}",
            diagnostics(&out, dir.path())
        ));
    }
    for (i, b) in buffers.iter().enumerate() {
        std::fs::write(dir.path().join(format!("b{i}.bin")), &b.bytes).map_err(|e| format!("buffer `{}`: {e}", b.name))?;
    }
    // Address space capped (16 GiB: every thread's stack is reserved up front), time capped below.
    // The environment is cleared: kernel code reads memory, and the parent's may hold API keys.
    let mut child = Command::new("sh")
        .env_clear()
        .envs(plain_env().into_iter().filter(|(k, _)| k == "PATH"))
        .args(["-c", "ulimit -v 16777216 2>/dev/null; exec \"$0\" \"$1\""])
        .arg(&exe)
        .arg(dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("run the emulated kernel: {e}"))?;
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| format!("wait for the emulated kernel: {e}"))? {
            break s;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("metal-emu: the kernel ran past {:.0} s", limit.as_secs_f64()));
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    if !status.success() {
        let why = err.lines().find(|l| l.starts_with("metal-emu:")).map(str::to_string);
        return Err(why.unwrap_or_else(|| format!("metal-emu: the kernel's process ended with {status}")));
    }
    for (i, b) in buffers.iter_mut().enumerate() {
        let back = std::fs::read(dir.path().join(format!("b{i}.bin"))).map_err(|e| format!("buffer `{}`: {e}", b.name))?;
        if back.len() != b.bytes.len() {
            return Err(format!(
                "buffer `{}` came back with {} bytes, not {}",
                b.name,
                back.len(),
                b.bytes.len()
            ));
        }
        b.bytes = back;
    }
    Ok(())
}

/// What the compiler and the executor may see of the environment: the search path, the
/// temporary folder and the locale, never a key.
fn plain_env() -> Vec<(String, String)> {
    std::env::vars()
        .filter(|(k, _)| ["PATH", "TMPDIR", "LANG"].contains(&k.as_str()) || k.starts_with("LC_"))
        .collect()
}

/// The executor's confinement once its buffers are loaded (Linux): no new privileges, and a
/// seccomp filter that lets through only what running threads as fibers and writing the buffers
/// back takes (memory, signal masks, reads and writes on open descriptors, exit); any other call
/// (open, fork, exec, socket, kill…) fails with EPERM, and a foreign architecture's calls kill the
/// process. Kernel code is C++ under the shim: this is what keeps a body (or a model's reply,
/// `ksearch translate`) from reaching past its buffers.
const LOCKDOWN: &str = r#"
#if defined(__linux__) && (defined(__x86_64__) || defined(__aarch64__))
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
static void ks_lockdown() {
#if defined(__x86_64__)
  const unsigned arch = AUDIT_ARCH_X86_64;
#else
  const unsigned arch = AUDIT_ARCH_AARCH64;
#endif
  static const long allowed[] = {
    SYS_read, SYS_write, SYS_pread64, SYS_pwrite64, SYS_readv, SYS_writev, SYS_lseek, SYS_close,
    SYS_mmap, SYS_munmap, SYS_mprotect, SYS_mremap, SYS_madvise, SYS_brk,
    SYS_rt_sigprocmask, SYS_rt_sigaction, SYS_rt_sigreturn, SYS_sigaltstack,
    SYS_futex, SYS_exit, SYS_exit_group, SYS_getpid, SYS_gettid, SYS_clock_gettime,
#if defined(__x86_64__)
    SYS_fstat, SYS_newfstatat,
#else
    SYS_fstat, SYS_newfstatat,
#endif
  };
  const unsigned n = sizeof(allowed) / sizeof(allowed[0]);
  struct sock_filter f[8 + 2 * (sizeof(allowed) / sizeof(allowed[0]))];
  unsigned k = 0;
  f[k++] = BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
  f[k++] = BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, arch, 1, 0);
  f[k++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
  f[k++] = BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
  f[k++] = BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1);  // x32 calls
  f[k++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
#endif
  for (unsigned i = 0; i < n; i++) {
    f[k++] = BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (unsigned)allowed[i], 0, 1);
    f[k++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
  }
  f[k++] = BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | 1);  // EPERM
  struct sock_fprog prog = {(unsigned short)k, f};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0)
    ks::fail("cannot confine the kernel (seccomp)");
}
#else
static void ks_lockdown() {}  // no seccomp here: the process limits alone
#endif
"#;

/// The call of an MLX body's kernel for launch `l`: buffers with their shape companions, then the
/// position attributes in `wrap_body`'s order (the driver's locals of the same names).
fn body_call(sig: &BodySig, sectioned: bool, l: &EmuLaunch, buffers: &[EmuBuffer]) -> Result<String, String> {
    let index = |n: &str| -> Result<usize, String> {
        buffers
            .iter()
            .position(|b| b.name == n)
            .ok_or_else(|| format!("no buffer `{n}` for the emulated run"))
    };
    let (ins, outs) = match sig.launches.iter().find(|x| x.entry == l.entry) {
        Some(x) => (x.inputs.clone(), x.outputs.clone()),
        None => (sig.inputs.clone(), sig.outputs.clone()),
    };
    let mut args = Vec::new();
    for (n, t) in &ins {
        let i = index(n)?;
        args.push(format!("(const {}*)ks_buf[{i}]", metal_type(t)));
        args.push(format!("ks_shape{i}"));
        args.push(format!("ks_strides{i}"));
        args.push(format!("ks_ndim{i}"));
    }
    for (n, t) in &outs {
        let i = index(n)?;
        let t = metal_type(t);
        let t = if sig.atomic_outputs {
            format!("metal::atomic<{t}>")
        } else {
            t
        };
        args.push(format!("({t}*)ks_buf[{i}]"));
    }
    args.extend(MLX_ATTRS.iter().map(|(a, _)| a.to_string()));
    let name = if sectioned {
        format!("ksearch_{}", l.entry)
    } else {
        "ksearch_body".to_string()
    };
    Ok(format!("{name}({})", args.join(", ")))
}

/// The executor's `main` for these launches: buffers from files (each ending at a guard page),
/// every threadgroup of every launch run in turn (launch j's threads run `calls[j]` with the
/// position attributes as locals), buffers written back.
fn driver(calls: &[String], launches: &[EmuLaunch], buffers: &[EmuBuffer]) -> Result<String, String> {
    let mut d = String::from("#include <algorithm>\n#include <csignal>\n#include <fcntl.h>\n#include <sys/stat.h>\n");
    d.push_str(LOCKDOWN);
    d.push_str("namespace {\nstruct KsLaunch { uint grid[3], tg[3], gpos[3], size[3]; };\nKsLaunch ks_L;\n");
    d.push_str(&format!("void* ks_buf[{}];\n", buffers.len().max(1)));
    for (i, b) in buffers.iter().enumerate() {
        let dims: Vec<String> = b.shape.iter().map(|x| x.to_string()).collect();
        let mut strides = vec![1usize; b.shape.len()];
        for k in (0..b.shape.len().saturating_sub(1)).rev() {
            strides[k] = strides[k + 1] * b.shape[k + 1];
        }
        let st: Vec<String> = strides.iter().map(|x| x.to_string()).collect();
        d.push_str(&format!(
            "int ks_shape{i}[] = {{{}0}};\nint64_t ks_strides{i}[] = {{{}0}};\nint ks_ndim{i} = {};\n",
            dims.iter().map(|x| format!("{x}, ")).collect::<String>(),
            st.iter().map(|x| format!("{x}, ")).collect::<String>(),
            b.shape.len()
        ));
    }
    for (j, call) in calls.iter().enumerate() {
        d.push_str(&format!(
            "void ks_thread{j}(int i) {{\n  const KsLaunch& L = ks_L;\n\
             const uint3 thread_position_in_threadgroup(uint(i) % L.size[0], uint(i) / L.size[0] % L.size[1], uint(i) / (L.size[0] * L.size[1]));\n\
             const uint3 threadgroup_position_in_grid(L.gpos[0], L.gpos[1], L.gpos[2]);\n\
             const uint3 thread_position_in_grid(L.gpos[0] * L.tg[0] + thread_position_in_threadgroup.x, \
             L.gpos[1] * L.tg[1] + thread_position_in_threadgroup.y, L.gpos[2] * L.tg[2] + thread_position_in_threadgroup.z);\n\
             const uint3 threads_per_grid(L.grid[0], L.grid[1], L.grid[2]);\n\
             const uint3 threads_per_threadgroup(L.size[0], L.size[1], L.size[2]);\n\
             const uint3 dispatch_threads_per_threadgroup(L.tg[0], L.tg[1], L.tg[2]);\n\
             const uint3 threadgroups_per_grid((L.grid[0] + L.tg[0] - 1) / L.tg[0], (L.grid[1] + L.tg[1] - 1) / L.tg[1], (L.grid[2] + L.tg[2] - 1) / L.tg[2]);\n\
             const uint n = L.size[0] * L.size[1] * L.size[2];\n\
             const uint thread_index_in_threadgroup = uint(i), thread_index_in_simdgroup = uint(i) % 32u;\n\
             const uint simdgroup_index_in_threadgroup = uint(i) / 32u, simdgroups_per_threadgroup = (n + 31u) / 32u;\n\
             const uint threads_per_simdgroup = 32u, thread_execution_width = 32u;\n\
             (void)dispatch_threads_per_threadgroup; (void)thread_execution_width;\n\
             {call};\n}}\n"
        ));
    }
    d.push_str(
        "void ks_fault(int) {\n  const char m[] = \"metal-emu: memory fault (an access past a buffer's end, or a thread's stack overflowed)\\n\";\n\
         if (write(2, m, sizeof(m) - 1)) {}\n  _exit(4);\n}\n\
         void* ks_load(const char* dir, int i, size_t& n, int& fd) {\n\
           char path[4096];\n  snprintf(path, sizeof path, \"%s/b%d.bin\", dir, i);\n\
           fd = open(path, O_RDWR);\n  if (fd < 0) ks::fail(\"cannot open a buffer file\");\n\
           struct stat st;\n  fstat(fd, &st);\n  n = (size_t)st.st_size;\n\
           const size_t page = (size_t)sysconf(_SC_PAGESIZE), span = (n + page - 1) / page * page;\n\
           char* base = (char*)mmap(nullptr, span + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);\n\
           if (base == (char*)MAP_FAILED) ks::fail(\"no memory for a buffer\");\n\
           mprotect(base + span, page, PROT_NONE);  // an access past the end faults\n\
           char* p = base + ((span - n) & ~(size_t)15);\n\
           for (size_t got = 0; got < n;) {\n    ssize_t r = read(fd, p + got, n - got);\n    if (r <= 0) ks::fail(\"cannot read a buffer file\");\n    got += (size_t)r;\n  }\n\
           return p;\n}\n",
    );
    // Buffers are loaded and the process confined in an ELF constructor of the first priority,
    // before any dynamic initialiser of the kernel's own code (a namespace-scope object's
    // constructor in a header) can run: from there on no new files, processes, sockets or
    // signals to others.
    d.push_str(&format!("size_t sizes[{0}];\nint fds[{0}];\n", buffers.len().max(1)));
    d.push_str(
        "__attribute__((constructor(101))) void ks_early(int argc, char** argv, char**) {\n  if (argc < 2) _exit(2);\n\
           static char alt[1 << 16];\n  stack_t ss{};\n  ss.ss_sp = alt;\n  ss.ss_size = sizeof alt;\n  sigaltstack(&ss, nullptr);\n\
           struct sigaction sa{};\n  sa.sa_handler = ks_fault;\n  sa.sa_flags = SA_ONSTACK;\n  sigaction(SIGSEGV, &sa, nullptr);\n  sigaction(SIGBUS, &sa, nullptr);\n",
    );
    for i in 0..buffers.len() {
        d.push_str(&format!("  ks_buf[{i}] = ks_load(argv[1], {i}, sizes[{i}], fds[{i}]);\n"));
    }
    d.push_str("  ks_lockdown();\n}\n}  // namespace\nint main() {\n");
    for (j, l) in launches.iter().enumerate() {
        let [gx, gy, gz] = l.grid;
        let [tx, ty, tz] = l.threadgroup;
        if l.grid.contains(&0) || l.threadgroup.contains(&0) {
            return Err(format!("launch `{}`: a grid or threadgroup size of 0", l.entry));
        }
        d.push_str(&format!(
            "  ks_L = KsLaunch{{{{{gx}u, {gy}u, {gz}u}}, {{{tx}u, {ty}u, {tz}u}}, {{0, 0, 0}}, {{0, 0, 0}}}};\n\
             for (uint z = 0; z < ({gz}u + {tz}u - 1) / {tz}u; z++)\n\
               for (uint y = 0; y < ({gy}u + {ty}u - 1) / {ty}u; y++)\n\
                 for (uint x = 0; x < ({gx}u + {tx}u - 1) / {tx}u; x++) {{\n\
                   ks_L.gpos[0] = x; ks_L.gpos[1] = y; ks_L.gpos[2] = z;\n\
                   ks_L.size[0] = std::min({tx}u, {gx}u - x * {tx}u);\n\
                   ks_L.size[1] = std::min({ty}u, {gy}u - y * {ty}u);\n\
                   ks_L.size[2] = std::min({tz}u, {gz}u - z * {tz}u);\n\
                   ks::run_group(int(ks_L.size[0] * ks_L.size[1] * ks_L.size[2]), ks_thread{j});\n\
                 }}\n"
        ));
    }
    for i in 0..buffers.len() {
        d.push_str(&format!(
            "  for (size_t done = 0; done < sizes[{i}];) {{\n\
                 const ssize_t w = pwrite(fds[{i}], (const char*)ks_buf[{i}] + done, sizes[{i}] - done, (off_t)done);\n\
                 if (w <= 0) ks::fail(\"cannot write a buffer file\");\n    done += (size_t)w;\n  }}\n"
        ));
    }
    d.push_str("  return 0;\n}\n");
    Ok(d)
}
