//! Secrets never leave: workers start with an environment reduced to an allow-list, and
//! everything that comes back from them (failure messages, compiler logs, stderr excerpts) is
//! scrubbed of the values that list did not pass — API keys above all — before it reaches the
//! terminal, the store or a prompt.

use ksearch_core::protocol::EvalReply;

/// Variables a worker may see, by exact name.
const ALLOW: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "LANG",
    "TMPDIR",
    "CXX",
    "CC",
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONUNBUFFERED",
    "VIRTUAL_ENV",
    "XDG_CACHE_HOME",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
];
/// Variables a worker may see, by prefix.
const ALLOW_PREFIX: &[&str] = &["LC_", "OMP_", "CUDA_", "NVIDIA_", "MLX_", "KSEARCH_"];
/// Names that mark a variable as secret even when its value is short or path-like.
const SECRET_WORDS: &[&str] = &["KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "AUTH", "CREDENTIAL"];

fn is_secret_name(name: &str) -> bool {
    let up = name.to_uppercase();
    SECRET_WORDS.iter().any(|w| up.contains(w))
}

/// Whether a worker may inherit variable `name`.
pub fn allowed(name: &str) -> bool {
    !is_secret_name(name) && (ALLOW.contains(&name) || ALLOW_PREFIX.iter().any(|p| name.starts_with(p)))
}

/// The allow-listed part of this process's environment.
pub fn worker_env() -> Vec<(String, String)> {
    std::env::vars().filter(|(k, _)| allowed(k)).collect()
}

/// A launcher's variable (Slurm's): not for the worker's allow-list, but no secret either.
fn launcher_var(name: &str) -> bool {
    (name.starts_with("SLURM_") || name.starts_with("SRUN_")) && !is_secret_name(name)
}

/// The variables a launcher needs beyond the worker's allow-list: Slurm's (`SLURM_*`, e.g.
/// `SLURM_CONF`, and the allocation a search runs inside) for `srun`. None with a secret name.
pub fn launcher_env(launcher: &crate::supervisor::Launcher) -> Vec<(String, String)> {
    match launcher {
        crate::supervisor::Launcher::Local => Vec::new(),
        crate::supervisor::Launcher::Slurm { .. } => std::env::vars().filter(|(k, _)| launcher_var(k)).collect(),
    }
}

/// The shortest run of letters and digits redacted as a piece of a secret.
const PIECE: usize = 8;

/// Replaces secret values with `[redacted]`.
#[derive(Debug, Clone, Default)]
pub struct Scrubber {
    secrets: Vec<String>,
    /// The secrets whose pieces are redacted too: values of variables named as secrets (or
    /// configured as keys), not the values guessed to be secret from their look.
    named: Vec<String>,
}

impl Scrubber {
    /// Secrets from this process's environment: every value of a variable whose name says it
    /// is secret, and every other value the allow-list did not pass unless it is short or a
    /// path (which cannot be told from ordinary text without redacting half of every log).
    /// `extra` names variables configured as holding keys (e.g. `[llm] api_key_env`).
    pub fn from_env(extra: &[String]) -> Scrubber {
        let (mut secrets, mut pieces) = (Vec::new(), Vec::new());
        for (k, v) in std::env::vars() {
            let v = v.trim().to_string();
            let named = is_secret_name(&k) || extra.iter().any(|e| e == &k);
            let unknown =
                !allowed(&k) && !launcher_var(&k) && v.len() >= 12 && !v.contains('/') && !v.contains(' ') && !v.contains(':');
            if named && v.len() >= 4 {
                pieces.push(v.clone());
            }
            if (named && v.len() >= 4) || unknown {
                secrets.push(v);
            }
        }
        let mut s = Scrubber { secrets, named: pieces };
        s.normalise();
        s
    }

    pub fn with_values(values: &[&str]) -> Scrubber {
        let secrets: Vec<String> = values.iter().filter(|v| v.len() >= 4).map(|v| v.to_string()).collect();
        let mut s = Scrubber {
            named: secrets.clone(),
            secrets,
        };
        s.normalise();
        s
    }

    fn normalise(&mut self) {
        // Longest first, so a secret containing another is replaced whole.
        self.secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
        self.secrets.dedup();
    }

    pub fn is_empty(&self) -> bool {
        self.secrets.is_empty()
    }

    /// `s` with every secret replaced, and every run of 8 or more letters and digits that is
    /// part of a secret: a compiler names a key's pieces one by one (`sk`, `proj`,
    /// `Canary0123456789…` of `sk-proj-Canary0123456789…`), never the whole value.
    pub fn text(&self, s: &str) -> String {
        let mut out = s.to_string();
        for secret in &self.secrets {
            if out.contains(secret.as_str()) {
                out = out.replace(secret.as_str(), "[redacted]");
            }
        }
        if self.named.is_empty() {
            return out;
        }
        let mut res = String::with_capacity(out.len());
        let mut run = String::new();
        let flush = |run: &mut String, res: &mut String| {
            // A piece is a run with a digit in it (a word of the language is not a key's piece).
            if run.len() >= PIECE
                && run.bytes().any(|b| b.is_ascii_digit())
                && self.named.iter().any(|x| x.contains(run.as_str()))
            {
                res.push_str("[redacted]");
            } else {
                res.push_str(run);
            }
            run.clear();
        };
        for c in out.chars() {
            if c.is_ascii_alphanumeric() {
                run.push(c);
            } else {
                flush(&mut run, &mut res);
                res.push(c);
            }
        }
        flush(&mut run, &mut res);
        res
    }

    fn text_mut(&self, s: &mut String) {
        if !self.secrets.is_empty() {
            let t = self.text(s);
            if t != *s {
                *s = t;
            }
        }
    }

    /// Scrub every text a worker's reply carries.
    pub fn reply(&self, r: &mut EvalReply) {
        if self.secrets.is_empty() {
            return;
        }
        self.text_mut(&mut r.compile.log);
        self.text_mut(&mut r.resources.raw);
        if let Some(f) = r.failure.as_mut() {
            self.text_mut(&mut f.message);
        }
        for w in &mut r.workloads {
            self.text_mut(&mut w.label);
            if let Some(f) = w.failure.as_mut() {
                self.text_mut(&mut f.message);
            }
            if let Some((_, a, b)) = w.check.first_bad.as_mut() {
                self.text_mut(a);
                self.text_mut(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn allow_list_drops_keys_and_unknown_variables() {
        assert!(allowed("PATH") && allowed("OMP_NUM_THREADS") && allowed("CUDA_VISIBLE_DEVICES"));
        assert!(!allowed("OPENAI_API_KEY") && !allowed("KSEARCH_API_KEY") && !allowed("AWS_SECRET_ACCESS_KEY"));
        assert!(!allowed("SOMETHING_ELSE"));
    }
    #[test]
    fn scrubs_every_text_of_a_reply() {
        let s = Scrubber::with_values(&["sk-live-abcdef123456", "abc"]);
        let mut r = EvalReply::failed(
            1,
            ksearch_core::protocol::FailureClass::Crash,
            "env: KEY=sk-live-abcdef123456 x",
        );
        r.compile.log = "sk-live-abcdef123456".into();
        s.reply(&mut r);
        assert_eq!(r.failure.unwrap().message, "env: KEY=[redacted] x");
        assert_eq!(r.compile.log, "[redacted]");
        // Values under four characters are not treated as secrets.
        assert_eq!(s.text("abc"), "abc");
    }
    #[test]
    fn scrubs_the_pieces_a_compiler_names_one_by_one() {
        let s = Scrubber::with_values(&["sk-proj-Canary0123456789abcdefXYZ"]);
        let log = "error: 'Canary0123456789abcdefXYZ' was not declared; 'proj' ...; '789abcdef' too; kernel_softmax ok";
        let t = s.text(log);
        assert!(!t.contains("Canary") && !t.contains("789abcdef"), "{t}");
        assert!(t.contains("kernel_softmax ok") && t.contains("'proj'"), "{t}");
        // Words are never pieces: "translation" stays, even when a secret contains it.
        let s = Scrubber::with_values(&["no_verified_translation_after_the_rounds"]);
        assert_eq!(s.text("the translation layer"), "the translation layer");
    }
}
