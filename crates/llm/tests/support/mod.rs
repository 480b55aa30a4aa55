//! A scripted OpenAI-compatible HTTP/1.1 server on 127.0.0.1 for the client tests: it records
//! every request and answers each with the next scripted reply (or with a handler's reply).
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use serde_json::{Value, json};

/// One scripted answer.
#[derive(Debug, Clone)]
pub enum Reply {
    /// A full HTTP response.
    Http {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
    },
    /// Read the request, then say nothing for this long, then close.
    Hang(Duration),
    /// Read the request, then close the connection without answering.
    Close,
    /// Announce `declared` body bytes, send only `body`, then close.
    Cut { declared: usize, body: String },
}

impl Reply {
    pub fn json(status: u16, body: Value) -> Reply {
        Reply::Http {
            status,
            headers: vec![],
            body: body.to_string(),
        }
    }
    pub fn text(status: u16, body: &str) -> Reply {
        Reply::Http {
            status,
            headers: vec![],
            body: body.to_string(),
        }
    }
    /// A chat completion with this content and usage.
    pub fn completion(content: &str, usage: Option<(u64, u64)>) -> Reply {
        Reply::json(200, completion_body(content, usage))
    }
    pub fn rate_limited(retry_after: &str) -> Reply {
        Reply::Http {
            status: 429,
            headers: vec![("Retry-After".into(), retry_after.into())],
            body: json!({"error": {"message": "Rate limit reached", "type": "rate_limit_error"}}).to_string(),
        }
    }
    pub fn server_error() -> Reply {
        Reply::json(500, json!({"error": {"message": "internal error", "type": "server_error"}}))
    }
}

pub fn completion_body(content: &str, usage: Option<(u64, u64)>) -> Value {
    let mut v = json!({
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "test-model-2025",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]
    });
    if let Some((p, c)) = usage {
        v["usage"] = json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    }
    v
}

/// A request as the server received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("request body is JSON")
    }
}

type Handler = dyn Fn(&Recorded, usize) -> Reply + Send + Sync;

pub struct Server {
    addr: std::net::SocketAddr,
    requests: Arc<Mutex<Vec<Recorded>>>,
    stop: Arc<AtomicBool>,
}

impl Server {
    /// Answer the i-th request with `script[i]`; past the end, 500 "script exhausted".
    pub fn scripted(script: Vec<Reply>) -> Server {
        Server::with_handler(move |_, i| {
            script
                .get(i)
                .cloned()
                .unwrap_or_else(|| Reply::text(500, "{\"error\":{\"message\":\"script exhausted\"}}"))
        })
    }

    /// Answer every request with `f(request, index)`.
    pub fn with_handler(f: impl Fn(&Recorded, usize) -> Reply + Send + Sync + 'static) -> Server {
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

    /// `http://127.0.0.1:PORT/v1`
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    pub fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr); // wake the accept loop
    }
}

/// Serve requests on one connection until it closes (each answer closes it).
fn serve(conn: TcpStream, reqs: Arc<Mutex<Vec<Recorded>>>, handler: Arc<Handler>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(match conn.try_clone() {
        Ok(c) => c,
        Err(_) => return,
    });
    let mut conn = conn;
    let Some(req) = read_request(&mut reader) else { return };
    let index = {
        let mut r = reqs.lock().unwrap();
        r.push(req.clone());
        r.len() - 1
    };
    match handler(&req, index) {
        Reply::Http { status, headers, body } => {
            let mut head = format!(
                "HTTP/1.1 {status} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
                reason(status),
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
        Reply::Cut { declared, body } => {
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\nConnection: close\r\n\r\n"
            );
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(body.as_bytes());
            let _ = conn.flush();
            let _ = conn.shutdown(Shutdown::Both);
        }
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Recorded> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
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
    Some(Recorded {
        method,
        path,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}
