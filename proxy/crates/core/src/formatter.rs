//! Envoy's substitution format strings (`SubstitutionFormatString`, text form): text
//! with `%COMMAND%`, `%COMMAND(arg)%` and `%COMMAND(arg):max_length%` operators,
//! rendered against a connection, and for HTTP a request and its stream's filter
//! state. What `set_filter_state` values are made of; the commands are those Istio's
//! configs use, and an unknown one is a config error naming it.
//!
//! As Envoy's text formatter, an operator with no value renders `-` (unless
//! `omit_empty_values`), and `%%` is a `%`.

use std::fmt::Write as _;

use hyper::HeaderMap;

use crate::stream_info::{Connection, FilterState};
use shunt_config::{Diagnostics, JsonPath};

/// One piece of a format string.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    Operator(Operator, Option<usize>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Operator {
    LocalAddress,
    LocalAddressWithoutPort,
    LocalPort,
    RemoteAddress,
    RemoteAddressWithoutPort,
    RemotePort,
    DirectRemoteAddress,
    DirectRemoteAddressWithoutPort,
    RequestedServerName,
    /// `%REQ(name?alternative)%`: a request header (pseudo-headers included).
    Request(String, Option<String>),
    /// `%FILTER_STATE(key:PLAIN)%` (`plain`), else the object's JSON string.
    FilterState {
        key: String,
        plain: bool,
    },
    Protocol,
    Hostname,
}

/// What a format string is rendered against.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub connection: &'a Connection,
    /// The HTTP stream's own filter state (the connection's is read below it).
    pub stream_filter_state: Option<&'a FilterState>,
    pub request: Option<Request<'a>>,
}

/// A request's head as `%REQ(...)%` reads it.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    pub authority: &'a str,
    pub path: &'a str,
    pub scheme: &'a str,
    pub protocol: &'a str,
    pub headers: &'a HeaderMap,
}

impl<'a> Context<'a> {
    pub fn connection(connection: &'a Connection) -> Self {
        Context {
            connection,
            stream_filter_state: None,
            request: None,
        }
    }
}

/// A compiled format string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Format {
    pieces: Vec<Piece>,
    omit_empty_values: bool,
}

impl Format {
    /// Compiles `text` at `path`; an unknown or malformed operator is an error.
    pub fn compile(text: &str, path: &JsonPath, problems: &mut Diagnostics) -> Option<Format> {
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(start) = rest.find('%') {
            if start > 0 {
                pieces.push(Piece::Text(rest[..start].to_owned()));
            }
            let after = &rest[start + 1..];
            if let Some(tail) = after.strip_prefix('%') {
                pieces.push(Piece::Text("%".into()));
                rest = tail;
                continue;
            }
            let Some(end) = operator_end(after) else {
                problems.error(path, format!("{text:?}: a '%' without its closing '%'"));
                return None;
            };
            let spec = &after[..end];
            match parse_operator(spec) {
                Ok(piece) => pieces.push(piece),
                Err(why) => {
                    problems.error(path, format!("{text:?}: %{spec}%: {why}"));
                    return None;
                }
            }
            rest = &after[end + 1..];
        }
        if !rest.is_empty() {
            pieces.push(Piece::Text(rest.to_owned()));
        }
        Some(Format {
            pieces,
            omit_empty_values: false,
        })
    }

    /// `omit_empty_values`: an operator without a value renders nothing, not `-`.
    pub fn omit_empty_values(mut self, omit: bool) -> Self {
        self.omit_empty_values = omit;
        self
    }

    pub fn render(&self, ctx: &Context<'_>) -> String {
        let mut out = String::new();
        for piece in &self.pieces {
            match piece {
                Piece::Text(text) => out.push_str(text),
                Piece::Operator(op, max) => match op.value(ctx) {
                    Some(mut value) => {
                        if let Some(max) = max
                            && value.len() > *max
                        {
                            let mut cut = *max;
                            while !value.is_char_boundary(cut) {
                                cut -= 1;
                            }
                            value.truncate(cut);
                        }
                        out.push_str(&value);
                    }
                    None if self.omit_empty_values => {}
                    None => out.push('-'),
                },
            }
        }
        out
    }
}

/// Where the operator that starts `after` ends: its closing `%`, skipping the `%`
/// inside a `(...)` argument.
fn operator_end(after: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in after.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            '%' if depth == 0 => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_operator(spec: &str) -> Result<Piece, String> {
    // COMMAND, COMMAND(arg), COMMAND(arg):max
    let (command, arg, tail) = match spec.find('(') {
        Some(open) => {
            let close = spec.rfind(')').ok_or("an argument without its ')'")?;
            if close < open {
                return Err("an argument without its ')'".into());
            }
            (
                &spec[..open],
                Some(&spec[open + 1..close]),
                &spec[close + 1..],
            )
        }
        None => match spec.split_once(':') {
            Some((command, _)) => (command, None, &spec[command.len()..]),
            None => (spec, None, ""),
        },
    };
    let max = match tail {
        "" => None,
        t => Some(
            t.strip_prefix(':')
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| format!("{t:?} is not a ':<max length>'"))?,
        ),
    };
    let no_arg = |op: Operator| match arg {
        None => Ok(op),
        Some(_) => Err(format!("{command} takes no argument")),
    };
    let op = match command {
        "DOWNSTREAM_LOCAL_ADDRESS" => no_arg(Operator::LocalAddress)?,
        "DOWNSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => no_arg(Operator::LocalAddressWithoutPort)?,
        "DOWNSTREAM_LOCAL_PORT" => no_arg(Operator::LocalPort)?,
        "DOWNSTREAM_REMOTE_ADDRESS" => no_arg(Operator::RemoteAddress)?,
        "DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => no_arg(Operator::RemoteAddressWithoutPort)?,
        "DOWNSTREAM_REMOTE_PORT" => no_arg(Operator::RemotePort)?,
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS" => no_arg(Operator::DirectRemoteAddress)?,
        "DOWNSTREAM_DIRECT_REMOTE_ADDRESS_WITHOUT_PORT" => {
            no_arg(Operator::DirectRemoteAddressWithoutPort)?
        }
        "REQUESTED_SERVER_NAME" => no_arg(Operator::RequestedServerName)?,
        "PROTOCOL" => no_arg(Operator::Protocol)?,
        "HOSTNAME" => no_arg(Operator::Hostname)?,
        "REQ" => {
            let arg = arg.ok_or("REQ needs a header name: %REQ(name)%")?;
            let (name, alternative) = match arg.split_once('?') {
                Some((a, b)) => (a, Some(b.to_ascii_lowercase())),
                None => (arg, None),
            };
            if name.is_empty() {
                return Err("REQ needs a header name".into());
            }
            Operator::Request(name.to_ascii_lowercase(), alternative)
        }
        "FILTER_STATE" => {
            let arg = arg.ok_or("FILTER_STATE needs a key: %FILTER_STATE(key)%")?;
            let (key, plain) = match arg.rsplit_once(':') {
                Some((key, "PLAIN")) => (key, true),
                Some((key, "TYPED")) => (key, false),
                Some((_, other)) if !other.contains('.') => {
                    return Err(format!(
                        "{other:?}: FILTER_STATE's format is PLAIN or TYPED"
                    ));
                }
                _ => (arg, false),
            };
            Operator::FilterState {
                key: key.to_owned(),
                plain,
            }
        }
        other => return Err(format!("the command {other} is not implemented by shunt")),
    };
    Ok(Piece::Operator(op, max))
}

impl Operator {
    fn value(&self, ctx: &Context<'_>) -> Option<String> {
        let c = ctx.connection;
        let mut out = String::new();
        match self {
            Operator::LocalAddress => write!(out, "{}", c.local).ok()?,
            Operator::LocalAddressWithoutPort => write!(out, "{}", c.local.ip()).ok()?,
            Operator::LocalPort => write!(out, "{}", c.local.port()).ok()?,
            Operator::RemoteAddress => write!(out, "{}", c.remote).ok()?,
            Operator::RemoteAddressWithoutPort => write!(out, "{}", c.remote.ip()).ok()?,
            Operator::RemotePort => write!(out, "{}", c.remote.port()).ok()?,
            Operator::DirectRemoteAddress => write!(out, "{}", c.direct_remote).ok()?,
            Operator::DirectRemoteAddressWithoutPort => {
                write!(out, "{}", c.direct_remote.ip()).ok()?
            }
            Operator::RequestedServerName => {
                return c.requested_server_name.clone().filter(|s| !s.is_empty());
            }
            Operator::Protocol => return ctx.request.map(|r| r.protocol.to_owned()),
            Operator::Hostname => {
                return hostname();
            }
            Operator::Request(name, alternative) => {
                let request = ctx.request?;
                return request_header(&request, name)
                    .or_else(|| request_header(&request, alternative.as_deref()?));
            }
            Operator::FilterState { key, plain } => {
                let entry = ctx
                    .stream_filter_state
                    .and_then(|s| s.get(key))
                    .or_else(|| c.filter_state.get(key))?;
                let text = entry.value.serialize_as_string()?;
                return Some(if *plain {
                    text
                } else {
                    serde_json::Value::String(text).to_string()
                });
            }
        }
        Some(out)
    }
}

fn request_header(request: &Request<'_>, name: &str) -> Option<String> {
    let value = match name {
        ":method" => request.method,
        ":authority" | "host" => request.authority,
        ":path" => request.path,
        ":scheme" => request.scheme,
        _ => {
            let value = request.headers.get(name)?;
            return Some(String::from_utf8_lossy(value.as_bytes()).into_owned());
        }
    };
    (!value.is_empty()).then(|| value.to_owned())
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::stream_info::{LifeSpan, StringAccessor};

    fn format(text: &str) -> Format {
        let mut problems = Diagnostics::default();
        Format::compile(text, &JsonPath::new("f"), &mut problems)
            .unwrap_or_else(|| panic!("{text}: {:?}", problems.errors))
    }

    #[test]
    fn renders_addresses_headers_and_filter_state() {
        let mut connection = Connection::new(
            "10.0.0.1:8080".parse().unwrap(),
            "10.0.0.2:5000".parse().unwrap(),
        );
        connection
            .filter_state
            .set(
                "k",
                Arc::new(StringAccessor("v".into())),
                false,
                LifeSpan::Connection,
            )
            .unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-b", "bee".parse().unwrap());
        let ctx = Context {
            connection: &connection,
            stream_filter_state: None,
            request: Some(Request {
                method: "GET",
                authority: "svc.ns:80",
                path: "/p",
                scheme: "http",
                protocol: "HTTP/1.1",
                headers: &headers,
            }),
        };
        let render = |text: &str| format(text).render(&ctx);
        assert_eq!(render("%REQ(:AUTHORITY)%"), "svc.ns:80");
        assert_eq!(render("%REQ(X-A?X-B)%/%REQ(x-b):2%"), "bee/be");
        assert_eq!(render("%REQ(x-missing)%"), "-");
        assert_eq!(
            render("%DOWNSTREAM_REMOTE_ADDRESS_WITHOUT_PORT%:%DOWNSTREAM_LOCAL_PORT%"),
            "10.0.0.2:8080"
        );
        assert_eq!(render("%FILTER_STATE(k:PLAIN)%"), "v");
        assert_eq!(render("%FILTER_STATE(k)%"), "\"v\"");
        assert_eq!(render("100%% %FILTER_STATE(none:PLAIN)%"), "100% -");
        let omit = format("a%REQ(x-missing)%b").omit_empty_values(true);
        assert_eq!(omit.render(&ctx), "ab");
        let no_request = Context::connection(&connection);
        assert_eq!(format("%REQ(x-b)%").render(&no_request), "-");
    }

    #[test]
    fn bad_operators_are_named() {
        for (text, says) in [
            ("%NOPE%", "NOPE is not implemented"),
            ("%REQ%", "REQ needs a header name"),
            ("%REQ(a", "without its closing"),
            ("%REQ(a):x%", "max length"),
        ] {
            let mut problems = Diagnostics::default();
            assert!(Format::compile(text, &JsonPath::new("at.path"), &mut problems).is_none());
            let error = format!("{:?}", problems.errors);
            assert!(
                error.contains(says) && error.contains("at.path"),
                "{text}: {error}"
            );
        }
    }
}
