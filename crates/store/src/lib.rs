//! ksearch-store: the world model on disk. One SQLite file (WAL, synchronous=FULL) holding
//! runs, the tree's nodes, candidates, evaluations per workload, LLM calls and artifacts.
//! Every write is its own committed transaction (or part of one the caller opens), so a
//! `kill -9` between two steps loses nothing that was reported.

use std::path::{Path, PathBuf};

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use ksearch_core::Backend;
use ksearch_core::protocol::{Candidate, EvalReply, FailureClass};
use ksearch_core::tree::{Action, Assessment, Impact, Node, NodeStatus};

/// Errors carry their cause as text, once: none of them has a `source`, so a chain printed
/// in full does not repeat it.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store {path}: {msg}")]
    Open { path: String, msg: String },
    #[error("store: {}", sql_text(.0))]
    Sql(rusqlite::Error),
    #[error("store: bad stored JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("no run {0} in the store")]
    NoRun(i64),
    #[error("store {path} has schema version {found}, newer than this ksearch ({known})")]
    TooNew { path: String, found: i64, known: i64 },
    #[error("run {run} is being driven by pid {pid} on {host} since {since}")]
    Locked {
        run: i64,
        pid: String,
        host: String,
        since: String,
    },
}

pub type Result<T> = std::result::Result<T, StoreError>;

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Sql(e)
    }
}

/// SQLite's message without the code it also carries (`file is not a database`, not that
/// plus `Error code 26`).
fn sql_text(e: &rusqlite::Error) -> String {
    match e {
        rusqlite::Error::SqliteFailure(_, Some(m)) if !m.is_empty() => m.clone(),
        rusqlite::Error::SqliteFailure(f, None) => f.to_string(),
        rusqlite::Error::FromSqlConversionFailure(_, _, e) => e.to_string(),
        other => other.to_string(),
    }
}

impl StoreError {
    /// The same error, naming the store's file (errors already naming it stay as they are).
    fn at(self, path: &str) -> StoreError {
        match self {
            StoreError::Sql(e) => StoreError::Open {
                path: path.into(),
                msg: sql_text(&e),
            },
            StoreError::Json(e) => StoreError::Open {
                path: path.into(),
                msg: format!("bad stored JSON: {e}"),
            },
            other => other,
        }
    }
}

/// Versioned migrations: entry `i` brings the schema from version `i` to `i + 1`.
const MIGRATIONS: &[&str] = &[
    // 1: runs, nodes, candidates, evaluations, artifacts
    r#"
    CREATE TABLE runs (
        id INTEGER PRIMARY KEY,
        task TEXT NOT NULL,
        backend TEXT NOT NULL,
        planner TEXT NOT NULL,
        status TEXT NOT NULL,
        round INTEGER NOT NULL DEFAULT 0,
        seed INTEGER NOT NULL,
        device TEXT NOT NULL DEFAULT '',
        config TEXT NOT NULL,
        best_node INTEGER,
        best_speedup REAL,
        stop_reason TEXT,
        report TEXT,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now')),
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now'))
    );
    CREATE TABLE candidates (
        key TEXT PRIMARY KEY,
        kernel TEXT NOT NULL,
        body TEXT NOT NULL
    );
    CREATE TABLE nodes (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        parent_id INTEGER REFERENCES nodes(id),
        action TEXT NOT NULL,
        title TEXT NOT NULL,
        pattern TEXT,
        status TEXT NOT NULL,
        candidate TEXT REFERENCES candidates(key),
        overall REAL NOT NULL,
        confidence REAL NOT NULL,
        bw_rating REAL NOT NULL, bw_note TEXT NOT NULL,
        reg_rating REAL NOT NULL, reg_note TEXT NOT NULL,
        hw_rating REAL NOT NULL, hw_note TEXT NOT NULL,
        difficulty INTEGER NOT NULL,
        prior REAL NOT NULL,
        visits INTEGER NOT NULL DEFAULT 0,
        failures INTEGER NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0,
        speedup REAL,
        time_us REAL,
        failure TEXT,
        round_created INTEGER NOT NULL,
        round_evaluated INTEGER,
        updated_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now'))
    );
    CREATE INDEX nodes_run ON nodes(run_id);
    CREATE TABLE evaluations (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        node_id INTEGER REFERENCES nodes(id),
        candidate TEXT,
        round INTEGER NOT NULL,
        purpose TEXT NOT NULL,
        ok INTEGER NOT NULL,
        failure_class TEXT,
        failure_message TEXT,
        compile_log TEXT NOT NULL DEFAULT '',
        compile_cached INTEGER NOT NULL DEFAULT 0,
        compile_s REAL NOT NULL DEFAULT 0,
        kernel_s REAL NOT NULL DEFAULT 0,
        overhead_s REAL NOT NULL DEFAULT 0,
        wall_s REAL NOT NULL DEFAULT 0,
        resources TEXT NOT NULL DEFAULT '{}',
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now'))
    );
    CREATE INDEX evaluations_run ON evaluations(run_id);
    CREATE TABLE eval_workloads (
        eval_id INTEGER NOT NULL REFERENCES evaluations(id),
        idx INTEGER NOT NULL,
        label TEXT NOT NULL,
        axes TEXT NOT NULL,
        seed INTEGER NOT NULL,
        ok INTEGER NOT NULL,
        median_us REAL, min_us REAL, spread REAL, reps INTEGER,
        max_abs_err REAL, max_rel_err REAL,
        mismatches INTEGER, unwritten INTEGER, nan INTEGER,
        bytes REAL, flops REAL, floor_us REAL,
        failure_class TEXT, failure_message TEXT,
        PRIMARY KEY (eval_id, idx)
    );
    CREATE TABLE artifacts (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        node_id INTEGER,
        kind TEXT NOT NULL,
        name TEXT NOT NULL,
        content TEXT NOT NULL,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now'))
    );
    "#,
    // 2: provenance of every LLM call
    r#"
    CREATE TABLE llm_calls (
        id INTEGER PRIMARY KEY,
        run_id INTEGER NOT NULL REFERENCES runs(id),
        node_id INTEGER,
        round INTEGER NOT NULL,
        role TEXT NOT NULL,
        model TEXT NOT NULL,
        prompt TEXT NOT NULL,
        reply TEXT,
        parsed TEXT,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        cost_usd REAL NOT NULL DEFAULT 0,
        latency_s REAL NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 1,
        error TEXT,
        created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ','now'))
    );
    CREATE INDEX llm_calls_run ON llm_calls(run_id);
    "#,
    // 3: the build each workload ran with, where a candidate is specialised per shape
    r#"
    ALTER TABLE eval_workloads ADD COLUMN defines TEXT;
    "#,
    // 4: the finishing phase that wrote a final-phase row (see `FINAL_PURPOSES`)
    r#"
    ALTER TABLE evaluations ADD COLUMN phase TEXT;
    CREATE INDEX evaluations_final ON evaluations(run_id, purpose, node_id);
    "#,
];

/// Purposes of the evaluations a run's finishing step writes (the re-timing of the best
/// against the seed, held-out validation and its second look at noisy timings, the native
/// baseline). A finishing step killed half
/// way is done again in full by `resume`: its rows replace the earlier phase's (see
/// `Store::insert_evaluation`), so they are neither kept twice nor counted twice.
pub const FINAL_PURPOSES: &[&str] = &["final", "heldout", "heldout-again", "baseline"];

/// A token naming one finishing phase: unique per process and handle.
fn phase_token() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{}-{nanos}-{n}", std::process::id())
}

pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// Ownership of one run (see `Store::lock_run`); released on drop.
#[derive(Debug)]
pub struct RunLock {
    file: Option<std::fs::File>,
    run: i64,
}

impl RunLock {
    /// The run this lock owns.
    pub fn run(&self) -> i64 {
        self.run
    }
}

impl Drop for RunLock {
    fn drop(&mut self) {
        if let Some(f) = self.file.take() {
            let _ = f.unlock();
        }
    }
}

/// This machine's name, as the lock file records it.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its whole length; gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "?".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// pid, host and start time recorded in a lock file (empty where missing).
fn owner_of(file: &Path) -> [String; 3] {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k).and_then(|v| v.strip_prefix('=')))
            .unwrap_or("")
            .trim()
            .to_string()
    };
    [field("pid"), field("host"), field("since")]
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunRow {
    pub id: i64,
    pub task: String,
    /// Stored as its spelling (`Backend::name`).
    pub backend: Backend,
    pub planner: String,
    pub status: String,
    pub round: u32,
    pub seed: u64,
    pub device: String,
    pub config: serde_json::Value,
    pub best_node: Option<i64>,
    pub best_speedup: Option<f64>,
    pub stop_reason: Option<String>,
    pub report: Option<serde_json::Value>,
    pub created_at: String,
    pub updated_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalRow {
    pub id: i64,
    pub node_id: Option<i64>,
    pub candidate: Option<String>,
    pub round: u32,
    pub purpose: String,
    pub reply: EvalReply,
    pub wall_s: f64,
    pub created_at: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlmCallRow {
    pub id: i64,
    pub node_id: Option<i64>,
    pub round: u32,
    pub role: String,
    pub model: String,
    pub prompt: String,
    pub reply: Option<String>,
    pub parsed: Option<String>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cost_usd: f64,
    pub latency_s: f64,
    pub attempts: u32,
    pub error: Option<String>,
    pub created_at: String,
}

pub struct Store {
    conn: Connection,
    /// The file (as given), for the lock files beside it.
    path: PathBuf,
    /// This handle's finishing phase: final-phase rows it writes replace those an earlier
    /// (killed or superseded) phase wrote for the same run, node and purpose.
    phase: String,
}

/// A path as the path part of an SQLite `file:` URI.
fn uri_path(path: &Path) -> String {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = String::new();
    for b in abs.display().to_string().bytes() {
        match b {
            b'%' | b'?' | b'#' | 0x80.. => out.push_str(&format!("%{b:02X}")),
            _ => out.push(b as char),
        }
    }
    out
}

fn status_of(s: &str) -> NodeStatus {
    NodeStatus::parse(s).unwrap_or(NodeStatus::Open)
}

impl Store {
    /// Open (creating if needed) and migrate the store at `path`.
    pub fn open(path: &Path) -> Result<Store> {
        let p = path.display().to_string();
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
                path: p.clone(),
                msg: format!("cannot create its folder: {e}"),
            })?;
        }
        let conn = Connection::open(path).map_err(|e| StoreError::Sql(e).at(&p))?;
        Self::setup(conn, path.to_path_buf(), &p).map_err(|e| e.at(&p))
    }

    /// Open an existing store for reading only: nothing is created (a missing store is an
    /// error naming its path) and nothing is written, so a read-only file or folder can be
    /// read. A store of an older schema is migrated in place first, where it can be written.
    pub fn open_read_only(path: &Path) -> Result<Store> {
        let p = path.display().to_string();
        if !path.is_file() {
            return Err(StoreError::Open {
                path: p,
                msg: if path.exists() {
                    "not a file".into()
                } else {
                    "no such file (no runs yet? `ksearch run` creates it)".into()
                },
            });
        }
        use rusqlite::OpenFlags;
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let open = |immutable: bool| -> Result<Store> {
            let conn = if immutable {
                // A WAL store in a folder this user cannot write: read the file as it is.
                let uri = format!("file:{}?immutable=1", uri_path(path));
                Connection::open_with_flags(uri, flags | OpenFlags::SQLITE_OPEN_URI)?
            } else {
                Connection::open_with_flags(path, flags)?
            };
            conn.busy_timeout(std::time::Duration::from_secs(10))?;
            let s = Store::with(conn, path.to_path_buf());
            let v = s.schema_version()?;
            if v > SCHEMA_VERSION {
                return Err(StoreError::TooNew {
                    path: p.clone(),
                    found: v,
                    known: SCHEMA_VERSION,
                });
            }
            // Read something real: a file that is not a database fails here.
            s.conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))?;
            Ok(s)
        };
        // Without a write-ahead log beside it the file holds everything and nobody has it
        // open: read it as immutable, which creates no `-wal`/`-shm` files. With one (a run
        // going on, or one that was killed), read through the log as SQLite does.
        let wal = PathBuf::from(format!("{}-wal", path.display()));
        let s = match open(!wal.exists()) {
            Ok(s) => s,
            Err(e @ StoreError::TooNew { .. }) => return Err(e),
            Err(StoreError::Sql(rusqlite::Error::SqliteFailure(f, _)))
                if f.code == rusqlite::ErrorCode::CannotOpen || f.code == rusqlite::ErrorCode::ReadOnly =>
            {
                open(true).map_err(|e| e.at(&p))?
            }
            Err(e) => return Err(e.at(&p)),
        };
        if s.schema_version().map_err(|e| e.at(&p))? < SCHEMA_VERSION {
            drop(s);
            return Store::open(path);
        }
        Ok(s)
    }

    fn setup(conn: Connection, path: PathBuf, p: &str) -> Result<Store> {
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        let mut s = Store::with(conn, path);
        // Processes opening a new store at once meet here: SQLite answers "busy" without
        // waiting in a few places (switching to WAL, a log being set up): try again for a while.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            match s.prepare(p) {
                Err(StoreError::Sql(rusqlite::Error::SqliteFailure(e, _)))
                    if matches!(
                        e.code,
                        rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
                    ) && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10 + u64::from(std::process::id() % 20)));
                }
                r => {
                    r?;
                    break;
                }
            }
        }
        s.conn.pragma_update(None, "synchronous", "FULL")?;
        s.conn.pragma_update(None, "foreign_keys", "ON")?;
        Ok(s)
    }

    fn with(conn: Connection, path: PathBuf) -> Store {
        Store {
            conn,
            path,
            phase: phase_token(),
        }
    }

    /// Refuse a newer schema before anything is written, switch to WAL, migrate.
    fn prepare(&mut self, p: &str) -> Result<()> {
        // Reading the version writes nothing: a store of a newer ksearch is left as it was
        // (switching it to WAL first would rewrite its header).
        self.refuse_newer(self.schema_version()?, p)?;
        self.conn.pragma_update(None, "journal_mode", "WAL")?;
        self.migrate(p)
    }

    fn refuse_newer(&self, v: i64, p: &str) -> Result<()> {
        if v > SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                path: p.into(),
                found: v,
                known: SCHEMA_VERSION,
            });
        }
        Ok(())
    }

    pub fn schema_version(&self) -> Result<i64> {
        Ok(self.conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
    }

    /// Every step from the store's version to this ksearch's in ONE transaction that holds
    /// the write lock from its start (IMMEDIATE), the version read again under it: processes
    /// opening a new store at once apply the migrations exactly once between them, and a
    /// store is never left between two versions.
    fn migrate(&mut self, p: &str) -> Result<()> {
        if self.schema_version()? == SCHEMA_VERSION {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let v: i64 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if v > SCHEMA_VERSION {
            return Err(StoreError::TooNew {
                path: p.into(),
                found: v,
                known: SCHEMA_VERSION,
            });
        }
        for sql in MIGRATIONS.iter().skip(v.max(0) as usize) {
            tx.execute_batch(sql)?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        tx.commit()?;
        Ok(())
    }

    /// Run `f` inside one transaction: all of its writes land together or not at all.
    pub fn atomic<T>(&mut self, f: impl FnOnce(&Store) -> Result<T>) -> Result<T> {
        self.conn.execute_batch("BEGIN IMMEDIATE")?;
        match f(self) {
            Ok(v) => {
                self.conn.execute_batch("COMMIT")?;
                Ok(v)
            }
            Err(e) => {
                let _ = self.conn.execute_batch("ROLLBACK");
                Err(e)
            }
        }
    }

    // ----- run ownership -----

    /// Take ownership of run `run`: only one process drives a run at a time.
    ///
    /// The lock is an OS advisory lock (`flock`) on `<store>.locks/run-<run>.lock`, a file
    /// created on demand beside the store and never removed. The owner writes its pid, host
    /// and start time (UTC) into it, for the message a second driver gets:
    /// `StoreError::Locked`, "run N is being driven by pid P on HOST since T". The lock
    /// belongs to the open file, not to the file's contents: it is released when the
    /// returned `RunLock` is dropped, and the kernel releases it when its process dies in any
    /// way (`kill -9` included), so a lock left by a dead process is free and the next
    /// driver simply takes it over. Within one process a second `lock_run` of a held run is
    /// refused too.
    ///
    /// Advisory locks are as good as the file system holding the store: local file systems
    /// honour them; a store on a network file system should stay with one host (the
    /// orchestrator's). An in-memory store needs no lock. Errors: `NoRun` for a run not in the
    /// store, `Open` (naming the lock file) when the lock file cannot be created or locked.
    /// Whether a process holds run `run`'s lock now (drives it). A run whose status says
    /// `running` while nobody holds its lock was left by a process that died. The lock file is
    /// opened read-only and never created; on a store in memory, the answer is yes.
    pub fn run_is_driven(&self, run: i64) -> bool {
        let p = self.path.display().to_string();
        if p.is_empty() || p == ":memory:" {
            return true;
        }
        let file = PathBuf::from(format!("{p}.locks")).join(format!("run-{run}.lock"));
        let Ok(f) = std::fs::File::open(&file) else {
            return false;
        };
        match f.try_lock_shared() {
            Ok(()) => {
                let _ = f.unlock();
                false
            }
            Err(_) => true,
        }
    }

    pub fn lock_run(&self, run: i64) -> Result<RunLock> {
        self.run(run)?;
        let p = self.path.display().to_string();
        if p.is_empty() || p == ":memory:" {
            return Ok(RunLock { file: None, run });
        }
        let dir = PathBuf::from(format!("{p}.locks"));
        let file = dir.join(format!("run-{run}.lock"));
        let err = |msg: String| StoreError::Open {
            path: file.display().to_string(),
            msg,
        };
        std::fs::create_dir_all(&dir).map_err(|e| err(format!("cannot create its folder: {e}")))?;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&file)
            .map_err(|e| err(format!("cannot open: {e}")))?;
        match f.try_lock() {
            Ok(()) => {
                use std::io::Write;
                let since: String = self
                    .conn
                    .query_row("SELECT strftime('%Y-%m-%dT%H:%M:%SZ','now')", [], |r| r.get(0))?;
                let owner = format!("pid={}\nhost={}\nsince={since}\n", std::process::id(), host_name());
                f.set_len(0)
                    .and_then(|_| f.write_all(owner.as_bytes()))
                    .and_then(|_| f.flush())
                    .map_err(|e| err(format!("cannot write the owner: {e}")))?;
                Ok(RunLock { file: Some(f), run })
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                // The owner writes its line just after locking: give it a moment.
                let mut fields = owner_of(&file);
                for _ in 0..20 {
                    if fields.iter().all(|v| !v.is_empty()) {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    fields = owner_of(&file);
                }
                let [pid, host, since] = fields.map(|v| if v.is_empty() { "?".to_string() } else { v });
                Err(StoreError::Locked { run, pid, host, since })
            }
            Err(std::fs::TryLockError::Error(e)) => Err(err(format!("cannot lock: {e}"))),
        }
    }

    // ----- runs -----

    pub fn create_run(
        &self,
        task: &str,
        backend: Backend,
        planner: &str,
        seed: u64,
        device: &str,
        config: &serde_json::Value,
    ) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO runs (task, backend, planner, status, seed, device, config) VALUES (?1, ?2, ?3, 'running', ?4, ?5, ?6)",
            params![task, backend.name(), planner, seed as i64, device, config.to_string()],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    fn run_from_row(r: &rusqlite::Row) -> rusqlite::Result<RunRow> {
        let cfg: String = r.get(8)?;
        let report: Option<String> = r.get(12)?;
        let id: i64 = r.get(0)?;
        let backend: String = r.get(2)?;
        let backend = backend.parse::<Backend>().map_err(|_| {
            let names: Vec<&str> = Backend::ALL.iter().map(|b| b.name()).collect();
            rusqlite::Error::FromSqlConversionFailure(
                2,
                rusqlite::types::Type::Text,
                format!("run {id}: unknown back-end `{backend}` (known: {})", names.join(", ")).into(),
            )
        })?;
        Ok(RunRow {
            id,
            task: r.get(1)?,
            backend,
            planner: r.get(3)?,
            status: r.get(4)?,
            round: r.get::<_, i64>(5)? as u32,
            seed: r.get::<_, i64>(6)? as u64,
            device: r.get(7)?,
            config: serde_json::from_str(&cfg).unwrap_or(serde_json::Value::Null),
            best_node: r.get(9)?,
            best_speedup: r.get(10)?,
            stop_reason: r.get(11)?,
            report: report.and_then(|s| serde_json::from_str(&s).ok()),
            created_at: r.get(13)?,
            updated_at: r.get(14)?,
        })
    }

    const RUN_COLS: &'static str = "id, task, backend, planner, status, round, seed, device, config, best_node, best_speedup, stop_reason, report, created_at, updated_at";

    pub fn run(&self, id: i64) -> Result<RunRow> {
        self.conn
            .query_row(
                &format!("SELECT {} FROM runs WHERE id = ?1", Self::RUN_COLS),
                [id],
                Self::run_from_row,
            )
            .optional()?
            .ok_or(StoreError::NoRun(id))
    }

    pub fn runs(&self) -> Result<Vec<RunRow>> {
        let mut st = self
            .conn
            .prepare(&format!("SELECT {} FROM runs ORDER BY id", Self::RUN_COLS))?;
        let rows = st.query_map([], Self::run_from_row)?.collect::<rusqlite::Result<Vec<_>>>()?;
        Ok(rows)
    }

    pub fn set_run_round(&self, id: i64, round: u32) -> Result<()> {
        self.conn.execute(
            "UPDATE runs SET round = ?2, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ','now') WHERE id = ?1",
            params![id, round as i64],
        )?;
        Ok(())
    }

    pub fn set_run_status(&self, id: i64, status: &str, stop_reason: Option<&str>) -> Result<()> {
        self.conn.execute(
            "UPDATE runs SET status = ?2, stop_reason = ?3, updated_at = strftime('%Y-%m-%dT%H:%M:%fZ','now') WHERE id = ?1",
            params![id, status, stop_reason],
        )?;
        Ok(())
    }

    pub fn set_run_best(&self, id: i64, node: i64, speedup: f64) -> Result<()> {
        self.conn.execute(
            "UPDATE runs SET best_node = ?2, best_speedup = ?3 WHERE id = ?1",
            params![id, node, speedup],
        )?;
        Ok(())
    }

    pub fn set_run_config(&self, id: i64, config: &serde_json::Value) -> Result<()> {
        self.conn
            .execute("UPDATE runs SET config = ?2 WHERE id = ?1", params![id, config.to_string()])?;
        Ok(())
    }

    pub fn set_run_device(&self, id: i64, device: &str) -> Result<()> {
        self.conn
            .execute("UPDATE runs SET device = ?2 WHERE id = ?1", params![id, device])?;
        Ok(())
    }

    pub fn set_run_report(&self, id: i64, report: &serde_json::Value) -> Result<()> {
        self.conn
            .execute("UPDATE runs SET report = ?2 WHERE id = ?1", params![id, report.to_string()])?;
        Ok(())
    }

    // ----- candidates -----

    pub fn put_candidate(&self, kernel: &str, c: &Candidate) -> Result<String> {
        let key = c.key();
        self.conn.execute(
            "INSERT OR IGNORE INTO candidates (key, kernel, body) VALUES (?1, ?2, ?3)",
            params![key, kernel, serde_json::to_string(c)?],
        )?;
        Ok(key)
    }

    pub fn candidate(&self, key: &str) -> Result<Option<(String, Candidate)>> {
        let row: Option<(String, String)> = self
            .conn
            .query_row("SELECT kernel, body FROM candidates WHERE key = ?1", [key], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        match row {
            Some((k, b)) => Ok(Some((k, serde_json::from_str(&b)?))),
            None => Ok(None),
        }
    }

    // ----- nodes -----

    pub fn insert_node(&self, run: i64, n: &Node) -> Result<i64> {
        let a = &n.assessment;
        self.conn.execute(
            "INSERT INTO nodes (run_id, parent_id, action, title, pattern, status, candidate, overall, confidence,
                bw_rating, bw_note, reg_rating, reg_note, hw_rating, hw_note, difficulty, prior, visits, failures, attempts,
                speedup, time_us, failure, round_created, round_evaluated)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25)",
            params![
                run,
                n.parent,
                serde_json::to_string(&n.action)?,
                n.action.summary(),
                n.pattern,
                n.status.name(),
                n.candidate,
                a.overall,
                a.confidence,
                a.bandwidth.rating,
                a.bandwidth.note,
                a.registers.rating,
                a.registers.note,
                a.hw_fit.rating,
                a.hw_fit.note,
                a.difficulty as i64,
                a.prior,
                n.visits as i64,
                n.failures as i64,
                n.attempts as i64,
                n.speedup,
                n.time_us,
                n.failure.map(|f| f.name()),
                n.round_created as i64,
                n.round_evaluated.map(|r| r as i64),
            ],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    pub fn update_node(&self, n: &Node) -> Result<()> {
        let a = &n.assessment;
        self.conn.execute(
            "UPDATE nodes SET status = ?2, candidate = ?3, overall = ?4, confidence = ?5, bw_rating = ?6, bw_note = ?7,
                reg_rating = ?8, reg_note = ?9, hw_rating = ?10, hw_note = ?11, difficulty = ?12, prior = ?13, visits = ?14,
                failures = ?15, attempts = ?16, speedup = ?17, time_us = ?18, failure = ?19, round_evaluated = ?20,
                action = ?21, title = ?22, pattern = ?23,
                updated_at = strftime('%Y-%m-%dT%H:%M:%fZ','now')
             WHERE id = ?1",
            params![
                n.id,
                n.status.name(),
                n.candidate,
                a.overall,
                a.confidence,
                a.bandwidth.rating,
                a.bandwidth.note,
                a.registers.rating,
                a.registers.note,
                a.hw_fit.rating,
                a.hw_fit.note,
                a.difficulty as i64,
                a.prior,
                n.visits as i64,
                n.failures as i64,
                n.attempts as i64,
                n.speedup,
                n.time_us,
                n.failure.map(|f| f.name()),
                n.round_evaluated.map(|r| r as i64),
                serde_json::to_string(&n.action)?,
                n.action.summary(),
                n.pattern,
            ],
        )?;
        Ok(())
    }

    pub fn nodes(&self, run: i64) -> Result<Vec<Node>> {
        let mut st = self.conn.prepare(
            "SELECT id, parent_id, action, pattern, status, candidate, overall, confidence, bw_rating, bw_note,
                reg_rating, reg_note, hw_rating, hw_note, difficulty, prior, visits, failures, attempts, speedup, time_us,
                failure, round_created, round_evaluated
             FROM nodes WHERE run_id = ?1 ORDER BY id",
        )?;
        let rows = st.query_map([run], |r| {
            let action: String = r.get(2)?;
            let status: String = r.get(4)?;
            let failure: Option<String> = r.get(21)?;
            Ok(Node {
                id: r.get(0)?,
                parent: r.get(1)?,
                action: serde_json::from_str(&action).unwrap_or(Action::Edit {
                    description: action.clone(),
                }),
                pattern: r.get(3)?,
                status: status_of(&status),
                candidate: r.get(5)?,
                assessment: Assessment {
                    overall: r.get(6)?,
                    confidence: r.get(7)?,
                    bandwidth: Impact {
                        rating: r.get(8)?,
                        note: r.get(9)?,
                    },
                    registers: Impact {
                        rating: r.get(10)?,
                        note: r.get(11)?,
                    },
                    hw_fit: Impact {
                        rating: r.get(12)?,
                        note: r.get(13)?,
                    },
                    difficulty: r.get::<_, i64>(14)? as u8,
                    prior: r.get(15)?,
                },
                visits: r.get::<_, i64>(16)? as u32,
                failures: r.get::<_, i64>(17)? as u32,
                attempts: r.get::<_, i64>(18)? as u32,
                speedup: r.get(19)?,
                time_us: r.get(20)?,
                failure: failure.and_then(|f| FailureClass::parse(&f)),
                round_created: r.get::<_, i64>(22)? as u32,
                round_evaluated: r.get::<_, Option<i64>>(23)?.map(|v| v as u32),
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }

    // ----- evaluations -----

    /// Record one evaluation and its per-workload rows, together (all or nothing).
    ///
    /// A row of the finishing step (`purpose` in `FINAL_PURPOSES`) first removes the rows of
    /// the same run, node and purpose that an earlier phase wrote (a finishing step killed half
    /// way, or one superseded by a later finish of the same run): rows are idempotent per
    /// (run, node, purpose, phase). Within one phase every row is kept (the seed is re-timed
    /// once per candidate). A phase is one `Store` handle until `new_phase` starts another.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_evaluation(
        &self,
        run: i64,
        node: Option<i64>,
        candidate: Option<&str>,
        round: u32,
        purpose: &str,
        reply: &EvalReply,
        wall_s: f64,
    ) -> Result<i64> {
        self.conn.execute_batch("SAVEPOINT insert_evaluation")?;
        let r = (|| {
            if FINAL_PURPOSES.contains(&purpose) {
                let stale = "SELECT id FROM evaluations WHERE run_id = ?1 AND purpose = ?2 AND node_id IS ?3
                     AND (phase IS NULL OR phase <> ?4)";
                let args = params![run, purpose, node, self.phase];
                self.conn
                    .execute(&format!("DELETE FROM eval_workloads WHERE eval_id IN ({stale})"), args)?;
                self.conn
                    .execute(&format!("DELETE FROM evaluations WHERE id IN ({stale})"), args)?;
            }
            self.insert_evaluation_row(run, node, candidate, round, purpose, reply, wall_s)
        })();
        match r {
            Ok(id) => {
                self.conn.execute_batch("RELEASE insert_evaluation")?;
                Ok(id)
            }
            Err(e) => {
                let _ = self
                    .conn
                    .execute_batch("ROLLBACK TO insert_evaluation; RELEASE insert_evaluation");
                Err(e)
            }
        }
    }

    /// Start a new finishing phase on this handle: the final-phase rows written from now on
    /// replace those written before (by this handle too). A driver that finishes the same run
    /// more than once through one handle calls it at the start of each finish.
    pub fn new_phase(&mut self) {
        self.phase = phase_token();
    }

    /// Remove the final-phase rows (`FINAL_PURPOSES`) of run `run` that an earlier phase wrote:
    /// a finish that starts again replaces all of them, also those of candidates it does not
    /// re-time this time. Returns how many evaluations were removed.
    pub fn drop_earlier_phases(&self, run: i64) -> Result<usize> {
        let list = FINAL_PURPOSES.iter().map(|p| format!("'{p}'")).collect::<Vec<_>>().join(", ");
        let stale =
            format!("SELECT id FROM evaluations WHERE run_id = ?1 AND purpose IN ({list}) AND (phase IS NULL OR phase <> ?2)");
        self.conn.execute_batch("SAVEPOINT drop_phases")?;
        let r = (|| {
            self.conn.execute(
                &format!("DELETE FROM eval_workloads WHERE eval_id IN ({stale})"),
                params![run, self.phase],
            )?;
            self.conn.execute(
                &format!("DELETE FROM evaluations WHERE id IN ({stale})"),
                params![run, self.phase],
            )
        })();
        match r {
            Ok(n) => {
                self.conn.execute_batch("RELEASE drop_phases")?;
                Ok(n)
            }
            Err(e) => {
                let _ = self.conn.execute_batch("ROLLBACK TO drop_phases; RELEASE drop_phases");
                Err(e.into())
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn insert_evaluation_row(
        &self,
        run: i64,
        node: Option<i64>,
        candidate: Option<&str>,
        round: u32,
        purpose: &str,
        reply: &EvalReply,
        wall_s: f64,
    ) -> Result<i64> {
        let f = reply.failure.as_ref();
        self.conn.execute(
            "INSERT INTO evaluations (run_id, node_id, candidate, round, purpose, ok, failure_class, failure_message, compile_log,
                compile_cached, compile_s, kernel_s, overhead_s, wall_s, resources, phase)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)",
            params![
                run,
                node,
                candidate,
                round as i64,
                purpose,
                reply.ok() as i64,
                f.map(|f| f.class.name()),
                f.map(|f| f.message.as_str()),
                reply.compile.log,
                reply.compile.cached as i64,
                reply.compile.seconds,
                reply.kernel_s,
                reply.overhead_s,
                wall_s,
                serde_json::to_string(&reply.resources)?,
                FINAL_PURPOSES.contains(&purpose).then_some(self.phase.as_str()),
            ],
        )?;
        let id = self.conn.last_insert_rowid();
        for (i, w) in reply.workloads.iter().enumerate() {
            let t = w.timing.as_ref();
            let wf = w.failure.as_ref();
            self.conn.execute(
                "INSERT INTO eval_workloads (eval_id, idx, label, axes, seed, ok, median_us, min_us, spread, reps, max_abs_err,
                    max_rel_err, mismatches, unwritten, nan, bytes, flops, floor_us, failure_class, failure_message, defines)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21)",
                params![
                    id,
                    i as i64,
                    w.label,
                    serde_json::to_string(&w.axes)?,
                    w.seed as i64,
                    (wf.is_none() && w.check.passed()) as i64,
                    t.map(|t| t.median_us),
                    t.map(|t| t.min_us),
                    t.map(|t| t.spread),
                    t.map(|t| t.reps as i64),
                    w.check.max_abs_err,
                    w.check.max_rel_err,
                    w.check.mismatches as i64,
                    w.check.unwritten as i64,
                    w.check.nan as i64,
                    w.bytes,
                    w.flops,
                    w.floor_us,
                    wf.map(|f| f.class.name()),
                    wf.map(|f| f.message.as_str()),
                    w.defines.as_ref().map(serde_json::to_string).transpose()?,
                ],
            )?;
        }
        Ok(id)
    }

    pub fn evaluations(&self, run: i64, node: Option<i64>) -> Result<Vec<EvalRow>> {
        let mut st = self.conn.prepare(
            "SELECT id, node_id, candidate, round, purpose, failure_class, failure_message, compile_log, compile_cached,
                compile_s, kernel_s, overhead_s, wall_s, resources, created_at
             FROM evaluations WHERE run_id = ?1 AND (?2 IS NULL OR node_id = ?2) ORDER BY id",
        )?;
        let heads = st
            .query_map(params![run, node], |r| {
                let fc: Option<String> = r.get(5)?;
                let fm: Option<String> = r.get(6)?;
                let res: String = r.get(13)?;
                let reply = EvalReply {
                    id: r.get::<_, i64>(0)? as u64,
                    compile: ksearch_core::protocol::CompileInfo {
                        log: r.get(7)?,
                        cached: r.get::<_, i64>(8)? != 0,
                        seconds: r.get(9)?,
                    },
                    resources: serde_json::from_str(&res).unwrap_or_default(),
                    workloads: Vec::new(),
                    failure: fc.map(|c| ksearch_core::protocol::Failure {
                        class: FailureClass::parse(&c).unwrap_or(FailureClass::Infra),
                        message: fm.unwrap_or_default(),
                    }),
                    kernel_s: r.get(10)?,
                    overhead_s: r.get(11)?,
                    ..EvalReply::default()
                };
                Ok(EvalRow {
                    id: r.get(0)?,
                    node_id: r.get(1)?,
                    candidate: r.get(2)?,
                    round: r.get::<_, i64>(3)? as u32,
                    purpose: r.get(4)?,
                    reply,
                    wall_s: r.get(12)?,
                    created_at: r.get(14)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(heads.len());
        let mut wst = self.conn.prepare(
            "SELECT label, axes, seed, median_us, min_us, spread, reps, max_abs_err, max_rel_err, mismatches, unwritten, nan,
                bytes, flops, floor_us, failure_class, failure_message, defines
             FROM eval_workloads WHERE eval_id = ?1 ORDER BY idx",
        )?;
        for mut h in heads {
            let ws = wst
                .query_map([h.id], |r| {
                    let axes: String = r.get(1)?;
                    let median: Option<f64> = r.get(3)?;
                    let fc: Option<String> = r.get(15)?;
                    Ok(ksearch_core::protocol::WorkloadResult {
                        label: r.get(0)?,
                        axes: serde_json::from_str(&axes).unwrap_or_default(),
                        seed: r.get::<_, i64>(2)? as u64,
                        check: ksearch_core::data::Check {
                            elements: 0,
                            mismatches: r.get::<_, Option<i64>>(9)?.unwrap_or(0) as usize,
                            unwritten: r.get::<_, Option<i64>>(10)?.unwrap_or(0) as usize,
                            nan: r.get::<_, Option<i64>>(11)?.unwrap_or(0) as usize,
                            max_abs_err: r.get::<_, Option<f64>>(7)?.unwrap_or(0.0),
                            max_rel_err: r.get::<_, Option<f64>>(8)?.unwrap_or(0.0),
                            first_bad: None,
                        },
                        timing: match median {
                            Some(m) => Some(ksearch_core::protocol::Timing {
                                median_us: m,
                                min_us: r.get::<_, Option<f64>>(4)?.unwrap_or(m),
                                spread: r.get::<_, Option<f64>>(5)?.unwrap_or(0.0),
                                reps: r.get::<_, Option<i64>>(6)?.unwrap_or(0) as u32,
                            }),
                            None => None,
                        },
                        bytes: r.get::<_, Option<f64>>(12)?.unwrap_or(0.0),
                        flops: r.get::<_, Option<f64>>(13)?.unwrap_or(0.0),
                        floor_us: r.get(14)?,
                        failure: fc.map(|c| ksearch_core::protocol::Failure {
                            class: FailureClass::parse(&c).unwrap_or(FailureClass::Infra),
                            message: r.get::<_, Option<String>>(16).ok().flatten().unwrap_or_default(),
                        }),
                        defines: r.get::<_, Option<String>>(17)?.and_then(|d| serde_json::from_str(&d).ok()),
                    })
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            h.reply.workloads = ws;
            out.push(h);
        }
        Ok(out)
    }

    pub fn count_evaluations(&self, run: i64) -> Result<u64> {
        Ok(self
            .conn
            .query_row("SELECT COUNT(*) FROM evaluations WHERE run_id = ?1", [run], |r| {
                r.get::<_, i64>(0)
            })? as u64)
    }

    // ----- artifacts -----

    pub fn put_artifact(&self, run: i64, node: Option<i64>, kind: &str, name: &str, content: &str) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO artifacts (run_id, node_id, kind, name, content) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![run, node, kind, name, content],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    pub fn artifacts(&self, run: i64, kind: &str) -> Result<Vec<(Option<i64>, String, String)>> {
        let mut st = self
            .conn
            .prepare("SELECT node_id, name, content FROM artifacts WHERE run_id = ?1 AND kind = ?2 ORDER BY id")?;
        let rows = st.query_map(params![run, kind], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }

    /// The newest artifact of `kind` named `name` in any run (e.g. what an LLM server was
    /// found to accept, remembered across runs).
    pub fn latest_artifact_named(&self, kind: &str, name: &str) -> Result<Option<String>> {
        let mut st = self
            .conn
            .prepare("SELECT content FROM artifacts WHERE kind = ?1 AND name = ?2 ORDER BY id DESC LIMIT 1")?;
        let mut rows = st.query_map(params![kind, name], |r| r.get::<_, String>(0))?;
        Ok(rows.next().transpose()?)
    }

    // ----- LLM calls -----

    pub fn insert_llm_call(&self, run: i64, c: &LlmCallRow) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO llm_calls (run_id, node_id, round, role, model, prompt, reply, parsed, prompt_tokens, completion_tokens,
                cost_usd, latency_s, attempts, error)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
            params![
                run,
                c.node_id,
                c.round as i64,
                c.role,
                c.model,
                c.prompt,
                c.reply,
                c.parsed,
                c.prompt_tokens as i64,
                c.completion_tokens as i64,
                c.cost_usd,
                c.latency_s,
                c.attempts as i64,
                c.error,
            ],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    pub fn llm_calls(&self, run: i64, node: Option<i64>) -> Result<Vec<LlmCallRow>> {
        let mut st = self.conn.prepare(
            "SELECT id, node_id, round, role, model, prompt, reply, parsed, prompt_tokens, completion_tokens, cost_usd,
                latency_s, attempts, error, created_at
             FROM llm_calls WHERE run_id = ?1 AND (?2 IS NULL OR node_id = ?2) ORDER BY id",
        )?;
        let rows = st.query_map(params![run, node], |r| {
            Ok(LlmCallRow {
                id: r.get(0)?,
                node_id: r.get(1)?,
                round: r.get::<_, i64>(2)? as u32,
                role: r.get(3)?,
                model: r.get(4)?,
                prompt: r.get(5)?,
                reply: r.get(6)?,
                parsed: r.get(7)?,
                prompt_tokens: r.get::<_, i64>(8)? as u64,
                completion_tokens: r.get::<_, i64>(9)? as u64,
                cost_usd: r.get(10)?,
                latency_s: r.get(11)?,
                attempts: r.get::<_, i64>(12)? as u32,
                error: r.get(13)?,
                created_at: r.get(14)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<Vec<_>>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ksearch_core::protocol::{Failure, Lang, WorkloadResult};
    use std::collections::BTreeMap;

    #[test]
    fn processes_opening_a_new_store_at_once_both_succeed() {
        for k in 0..10 {
            let d = tempfile::tempdir().unwrap();
            let p = d.path().join(format!("s{k}.db"));
            let hs: Vec<_> = (0..3)
                .map(|_| {
                    let p = p.clone();
                    std::thread::spawn(move || Store::open(&p).map(|s| s.schema_version().unwrap()))
                })
                .collect();
            for h in hs {
                assert_eq!(h.join().unwrap().unwrap(), SCHEMA_VERSION);
            }
        }
    }

    #[test]
    fn back_ends_are_stored_by_their_spelling_and_an_unknown_one_is_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("s.db")).unwrap();
        for b in Backend::ALL {
            let id = s.create_run("t", b, "offline", 1, "", &serde_json::json!({})).unwrap();
            assert_eq!(s.run(id).unwrap().backend, b);
            let text: String = s
                .conn
                .query_row("SELECT backend FROM runs WHERE id = ?1", [id], |r| r.get(0))
                .unwrap();
            assert_eq!(text, b.name());
        }
        s.conn.execute("UPDATE runs SET backend = 'rocm' WHERE id = 2", []).unwrap();
        let e = s.run(2).unwrap_err().to_string();
        assert!(
            e.contains("run 2: unknown back-end `rocm`") && e.contains("mlx-metal") && !e.contains('\n'),
            "{e}"
        );
        assert!(s.runs().is_err());
        assert_eq!(s.run(1).unwrap().backend, Backend::Cpu);
    }

    #[test]
    fn round_trip_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let run;
        let nid;
        {
            let s = Store::open(&path).unwrap();
            assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
            run = s
                .create_run(
                    "softmax",
                    Backend::Cpu,
                    "offline",
                    7,
                    "dev",
                    &serde_json::json!({"rounds": 3}),
                )
                .unwrap();
            let mut n = Node::new(0, None, Action::Seed, None, Assessment::default(), 0);
            nid = s.insert_node(run, &n).unwrap();
            n.id = nid;
            n.status = NodeStatus::Solved;
            n.speedup = Some(1.0);
            s.update_node(&n).unwrap();
            let c = Candidate {
                lang: Lang::Cpp,
                source: "x".into(),
                launches: vec![],
                scratch: vec![],
                defines: BTreeMap::new(),
                options: BTreeMap::new(),
            };
            let key = s.put_candidate("seed", &c).unwrap();
            assert_eq!(s.put_candidate("seed", &c).unwrap(), key);
            let mut reply = EvalReply::failed(1, FailureClass::Wrong, "bad");
            reply.workloads.push(WorkloadResult {
                label: "a=1".into(),
                failure: Some(Failure {
                    class: FailureClass::Nan,
                    message: "nan".into(),
                }),
                ..Default::default()
            });
            s.insert_evaluation(run, Some(nid), Some(&key), 1, "search", &reply, 0.5)
                .unwrap();
            s.set_run_round(run, 4).unwrap();
        }
        let s = Store::open(&path).unwrap();
        let r = s.run(run).unwrap();
        assert_eq!((r.round, r.seed, r.task.as_str()), (4, 7, "softmax"));
        let nodes = s.nodes(run).unwrap();
        assert_eq!(nodes.len(), 1);
        assert_eq!(nodes[0].status, NodeStatus::Solved);
        let ev = s.evaluations(run, Some(nid)).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].reply.failure.as_ref().unwrap().class, FailureClass::Wrong);
        assert_eq!(ev[0].reply.workloads[0].failure.as_ref().unwrap().class, FailureClass::Nan);
        assert!(matches!(s.run(999), Err(StoreError::NoRun(999))));
    }

    #[test]
    fn atomic_rolls_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(&dir.path().join("s.db")).unwrap();
        let run = s
            .create_run("t", Backend::Cpu, "offline", 1, "", &serde_json::json!({}))
            .unwrap();
        let r: Result<()> = s.atomic(|s| {
            s.set_run_round(run, 9)?;
            Err(StoreError::NoRun(0))
        });
        assert!(r.is_err());
        assert_eq!(s.run(run).unwrap().round, 0);
    }

    /// A store of version 3 (before final-phase rows carried their phase) is migrated in one
    /// step, keeps its rows, and its final rows are replaced by the next finish's.
    #[test]
    fn an_older_store_migrates_and_its_final_rows_are_superseded() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("old.db");
        {
            let c = Connection::open(&p).unwrap();
            for m in &MIGRATIONS[..3] {
                c.execute_batch(m).unwrap();
            }
            c.pragma_update(None, "user_version", 3).unwrap();
            c.execute_batch(
                "INSERT INTO runs (id, task, backend, planner, status, seed, config) VALUES (1, 't', 'cpu', 'offline', 'done', 1, '{}');
                 INSERT INTO evaluations (run_id, node_id, round, purpose, ok) VALUES (1, NULL, 0, 'baseline', 1), (1, NULL, 0, 'baseline', 1), (1, NULL, 0, 'search', 1);",
            )
            .unwrap();
        }
        let s = Store::open(&p).unwrap();
        assert_eq!(s.schema_version().unwrap(), SCHEMA_VERSION);
        assert_eq!(s.count_evaluations(1).unwrap(), 3);
        s.insert_evaluation(
            1,
            None,
            None,
            1,
            "baseline",
            &EvalReply::failed(1, FailureClass::Infra, "x"),
            0.1,
        )
        .unwrap();
        let left: Vec<String> = s.evaluations(1, None).unwrap().into_iter().map(|e| e.purpose).collect();
        assert_eq!(left, vec!["search", "baseline"]);
    }

    #[test]
    fn refuses_newer_schema() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.db");
        {
            let c = Connection::open(&p).unwrap();
            c.pragma_update(None, "user_version", 99).unwrap();
        }
        assert!(matches!(Store::open(&p), Err(StoreError::TooNew { .. })));
    }
}
