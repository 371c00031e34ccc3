//! What `curl -i` printed, as the differential tests compare it between Envoy and shunt.

use std::collections::HashMap;

#[derive(Debug, PartialEq)]
pub struct Response {
    pub status: u16,
    /// Lowercase names; a repeated header keeps its last value.
    pub headers: HashMap<String, String>,
    pub body: String,
}

impl Response {
    /// The last response in `text` (interim `100 Continue` heads before it are skipped).
    pub fn parse(text: &str) -> Response {
        let start = text.rfind("\r\n\r\nHTTP/").map_or(0, |i| i + 4);
        let (head, body) = text[start..]
            .split_once("\r\n\r\n")
            .unwrap_or((&text[start..], ""));
        let mut lines = head.lines();
        let status = lines
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        Response {
            status,
            headers,
            body: body.to_owned(),
        }
    }
}
