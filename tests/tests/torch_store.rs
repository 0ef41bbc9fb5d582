//! ccl's client of torch's store ([`ccl::TorchTcpStore`]) against the real
//! thing: a `torch.distributed.TCPStore` server started by Python from the
//! virtual environment `CCL_TEST_VENV` names, with both of torch's server
//! implementations (libuv, the default, and the older one). Values set on
//! either side are read on the other. Without the environment the test
//! fails under CI (`CI=true`) and is skipped elsewhere.

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use ccl::{Error, Store, TorchTcpStore};
use ccl_tests::torch_venv;

/// The Python side: serves a TCPStore, prints its port, sets a key, sets
/// another once Rust waits for it, and prints what Rust left behind once
/// Rust says it is done; then waits for its stdin to close.
const SERVER: &str = r#"
import datetime, sys, time
import torch.distributed as d
s = d.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
               timeout=datetime.timedelta(seconds=60), use_libuv=sys.argv[1] == "libuv")
s.set("from_python", b"py\x00\xff")
print(s.port, flush=True)
s.wait(["rust_waits"])
time.sleep(0.3)
s.set("late", b"late value")
s.wait(["rust_done"])
print("from_rust", s.get("from_rust").hex(), flush=True)
print("counter", s.add("counter", 0), flush=True)
print("cas", s.get("cas").hex(), flush=True)
print("to_delete", s.check(["to_delete"]), flush=True)
print("unset_cas", s.check(["unset_cas"]), flush=True)
sys.stdin.read()
"#;

/// A Python process serving a TCPStore, and its stdout by line.
struct Server {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Server {
    fn start(python: &std::path::Path, backend: &str) -> Server {
        let mut child = Command::new(python)
            .args(["-c", SERVER, backend])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start python");
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Server { child, lines }
    }

    fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(60))
            .expect("a line from the Python side within 60 s")
    }

    /// The value it printed for `name`.
    fn said(&self, name: &str) -> String {
        let line = self.line();
        let value = line.strip_prefix(name).and_then(|v| v.strip_prefix(' '));
        value
            .unwrap_or_else(|| panic!("expected {name}, got {line:?}"))
            .to_string()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn against(python: &std::path::Path, backend: &str) {
    let server = Server::start(python, backend);
    let port: u16 = server.line().parse().expect("the port");
    let s = TorchTcpStore::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    assert!(s.describe().starts_with("torch store tcp://127.0.0.1:"));

    // Set by Python, read here; unset keys read as unset (where torch's
    // older server would drop a GET of them), and the connection lives on.
    assert_eq!(s.try_get("from_python").unwrap().unwrap(), b"py\x00\xff");
    assert_eq!(s.try_get("nothing").unwrap(), None);
    assert_eq!(
        s.get("from_python", Duration::from_secs(5)).unwrap(),
        b"py\x00\xff"
    );

    s.set("from_rust", b"rust\x00\x01").unwrap();
    assert_eq!(s.add("counter", 5).unwrap(), 5);
    assert_eq!(s.add("counter", -2).unwrap(), 3);
    assert_eq!(s.compare_set("cas", None, b"v1").unwrap(), b"v1");
    assert_eq!(s.compare_set("cas", Some(b"x"), b"v2").unwrap(), b"v1");
    assert_eq!(s.compare_set("cas", Some(b"v1"), b"v2").unwrap(), b"v2");
    assert_eq!(s.compare_set("unset_cas", Some(b"e"), b"d").unwrap(), b"");
    assert_eq!(s.try_get("unset_cas").unwrap(), None);
    s.set("to_delete", b"x").unwrap();
    assert!(s.delete("to_delete").unwrap());
    assert!(!s.delete("to_delete").unwrap());
    assert_eq!(s.try_get("to_delete").unwrap(), None);
    let big: Vec<u8> = (0..3 << 20).map(|i| (i % 251) as u8).collect();
    s.set("big", &big).unwrap();
    assert_eq!(s.try_get("big").unwrap().unwrap(), big);

    // A wait that times out names what is missing, and the connection
    // still serves afterwards.
    let start = Instant::now();
    let e = s
        .wait(&["from_python", "never"], Duration::from_millis(200))
        .unwrap_err();
    let took = start.elapsed();
    assert!(
        matches!(&e, Error::Timeout { what, after, .. }
            if what == r#"keys ["never"]"# && *after == Duration::from_millis(200)),
        "{e}"
    );
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(3),
        "{took:?}"
    );
    s.wait(&["from_python"], Duration::ZERO).unwrap();

    // A wait that Python ends by setting the key.
    s.set("rust_waits", b"").unwrap();
    let start = Instant::now();
    assert_eq!(
        s.get("late", Duration::from_secs(30)).unwrap(),
        b"late value"
    );
    assert!(
        start.elapsed() >= Duration::from_millis(200),
        "{:?}",
        start.elapsed()
    );

    s.set("rust_done", b"").unwrap();
    assert_eq!(server.said("from_rust"), hex(b"rust\x00\x01"));
    assert_eq!(server.said("counter"), "3");
    assert_eq!(server.said("cas"), hex(b"v2"));
    assert_eq!(server.said("to_delete"), "False");
    assert_eq!(server.said("unset_cas"), "False");
}

#[test]
fn the_client_speaks_torchs_protocol_to_both_of_its_servers() {
    let Some(venv) = torch_venv() else { return };
    let python = venv.join("bin/python");
    for backend in ["libuv", "legacy"] {
        against(&python, backend);
    }
}

/// A server that died: the client's next call fails promptly, naming it.
#[test]
fn a_torch_server_that_is_gone_is_an_error_not_a_hang() {
    let Some(venv) = torch_venv() else { return };
    let mut server = Server::start(&venv.join("bin/python"), "libuv");
    let port: u16 = server.line().parse().expect("the port");
    let s = TorchTcpStore::connect("127.0.0.1", port, Duration::from_secs(30)).unwrap();
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let start = Instant::now();
    let e = s.wait(&["never"], Duration::from_secs(30)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert!(
        matches!(&e, Error::Store { addr, .. } if addr.contains(&port.to_string())),
        "{e}"
    );
}
