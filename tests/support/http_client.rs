//! A keep-alive HTTP/1.1 client connection from inside a pod, reading each response
//! whole (by `content-length`), so one connection can carry many requests.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use harness::Pod;

pub struct HttpClient {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl HttpClient {
    /// Connects from inside `pod` to its `127.0.0.1:port`.
    pub fn connect(pod: &Pod, port: u16) -> HttpClient {
        let stream = pod
            .run_in_netns(move || TcpStream::connect(super::local(port)))
            .expect("entering the pod")
            .expect("connecting to the listener");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        HttpClient {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    /// GET `path` with `Host: svc.example`: the status and body.
    pub fn get(&mut self, path: &str) -> (u16, String) {
        let request = format!("GET {path} HTTP/1.1\r\nHost: svc.example\r\n\r\n");
        self.writer.write_all(request.as_bytes()).expect("sending");
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("status line");
        let status = line.split(' ').nth(1).and_then(|s| s.parse().ok());
        let status = status.unwrap_or_else(|| panic!("no status in {line:?}"));
        let mut length = 0usize;
        loop {
            line.clear();
            self.reader.read_line(&mut line).expect("a header");
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body).expect("the body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}
