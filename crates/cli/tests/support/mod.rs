//! A scripted OpenAI-compatible chat-completions server on 127.0.0.1:0 for the CLI's LLM tests.
//! Each request is classified (planner init, planner update, coder, repair) from its prompt and
//! answered by the test's handler.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};

#[derive(Debug, Clone)]
pub enum Reply {
    Http {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// Read the request, say nothing for this long, close.
    Hang(Duration),
    /// Read the request, close without answering.
    Close,
}

impl Reply {
    pub fn completion(content: &str) -> Reply {
        Reply::completion_with(content, true)
    }
    pub fn completion_with(content: &str, usage: bool) -> Reply {
        let mut v = json!({
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "scripted-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
        });
        if usage {
            v["usage"] = json!({"prompt_tokens": 1000, "completion_tokens": 200, "total_tokens": 1200});
        }
        Reply::Http {
            status: 200,
            headers: vec![],
            body: v.to_string(),
        }
    }
    pub fn status(status: u16, headers: Vec<(String, String)>, body: Value) -> Reply {
        Reply::Http {
            status,
            headers,
            body: body.to_string(),
        }
    }
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Init,
    Update,
    Coder,
    /// A repair prompt after an unusable reply; `of` is what the conversation started as.
    Repair {
        of: Base,
    },
    Other,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Init,
    Update,
    Coder,
    Other,
}

#[derive(Debug, Clone)]
pub struct Req {
    pub headers: Vec<(String, String)>,
    pub body: Value,
    pub kind: Kind,
    /// The last user message.
    pub user: String,
}

impl Req {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// The node id of the latest evaluation in a planner update prompt.
    pub fn evaluated_node(&self) -> Option<i64> {
        let first_user = self.first_user();
        let i = first_user.rfind("### Node ")?;
        digits(&first_user[i + 9..])
    }
    /// The root's id (first node of the active path) in a planner update prompt.
    pub fn root_node(&self) -> Option<i64> {
        let u = self.first_user();
        let i = u.find("## Active path")?;
        let j = u[i..].find("- [")? + i + 3;
        digits(&u[j..])
    }
    fn first_user(&self) -> String {
        self.body["messages"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["role"] == "user"))
            .and_then(|m| m["content"].as_str())
            .unwrap_or("")
            .to_string()
    }
}

fn digits(s: &str) -> Option<i64> {
    s.chars().take_while(|c| c.is_ascii_digit()).collect::<String>().parse().ok()
}

fn classify(body: &Value) -> (Kind, String) {
    let msgs = body["messages"].as_array().cloned().unwrap_or_default();
    let system = msgs
        .iter()
        .find(|m| m["role"] == "system")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let last_user = msgs
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
        .to_string();
    let base = if system.contains("You maintain a search tree") {
        Base::Init
    } else if system.contains("revise the search tree") {
        Base::Update
    } else if system.contains("expert kernel engineer") {
        Base::Coder
    } else {
        Base::Other
    };
    let kind = if last_user.starts_with("Your previous reply could not be used") {
        Kind::Repair { of: base }
    } else {
        match base {
            Base::Init => Kind::Init,
            Base::Update => Kind::Update,
            Base::Coder => Kind::Coder,
            Base::Other => Kind::Other,
        }
    };
    (kind, last_user)
}

type Handler = dyn Fn(&Req, usize) -> Reply + Send + Sync;

pub struct Server {
    addr: std::net::SocketAddr,
    requests: Arc<Mutex<Vec<Req>>>,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Answer each request with `f(request, index of the request among those of its kind)`.
    pub fn new(f: impl Fn(&Req, usize) -> Reply + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let handler: Arc<Handler> = Arc::new(f);
        let (reqs, stop2) = (requests.clone(), stop.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (reqs, handler) = (reqs.clone(), handler.clone());
                thread::spawn(move || serve(conn, reqs, handler));
            }
        });
        Server { addr, requests, stop }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn requests(&self) -> Vec<Req> {
        self.requests.lock().unwrap().clone()
    }

    pub fn count(&self, kind: Kind) -> usize {
        self.requests().iter().filter(|r| r.kind == kind).count()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
    }
}

fn serve(conn: TcpStream, reqs: Arc<Mutex<Vec<Req>>>, handler: Arc<Handler>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut conn = conn;
    let Some((headers, body)) = read_request(&mut reader) else {
        return;
    };
    let body: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let (kind, user) = classify(&body);
    let req = Req {
        headers,
        body,
        kind,
        user,
    };
    let index = {
        let mut r = reqs.lock().unwrap();
        let i = r.iter().filter(|x| x.kind == kind).count();
        r.push(req.clone());
        i
    };
    match handler(&req, index) {
        Reply::Http { status, headers, body } => {
            let mut head = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(body.as_bytes());
            let _ = conn.flush();
            let _ = conn.shutdown(Shutdown::Both);
        }
        Reply::Hang(d) => {
            thread::sleep(d);
            let _ = conn.shutdown(Shutdown::Both);
        }
        Reply::Close => {
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<(Vec<(String, String)>, String)> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    let len: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).ok()?;
    Some((headers, String::from_utf8_lossy(&body).into_owned()))
}
