//! Envoy's substitution format strings (`SubstitutionFormatString`, text form): text
//! with `%COMMAND%`, `%COMMAND(arg)%` and `%COMMAND(arg):max_length%` operators,
//! rendered against a connection, and for HTTP a request and its stream's filter
//! state. What `set_filter_state` values are made of; the commands are those Istio's
//! configs use, and an unknown one is a config error naming it.
//!
//! As Envoy's text formatter, an operator with no value renders `-` (unless
//! `omit_empty_values`), and `%%` is a `%`. The commands that describe a finished
//! request or connection (`%RESPONSE_CODE%`, `%BYTES_SENT%`, `%UPSTREAM_HOST%`...) read
//! its access-log [`Entry`]; without one (a `set_filter_state` value) they render `-`.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use hyper::HeaderMap;

use crate::access_log::Entry;
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
    /// `%REQ_WITHOUT_QUERY(name?alternative)%` (Istio's formatter extension).
    RequestWithoutQuery(String, Option<String>),
    /// `%RESP(name?alternative)%`: a response header.
    Response(String, Option<String>),
    /// `%START_TIME%` / `%START_TIME(format)%`.
    StartTime(Option<TimeFormat>),
    ResponseCode,
    ResponseCodeDetails,
    ResponseFlags,
    RouteName,
    ConnectionTerminationDetails,
    BytesReceived,
    BytesSent,
    Duration,
    UpstreamHost,
    UpstreamRemoteAddressWithoutPort,
    UpstreamRemotePort,
    UpstreamCluster,
    UpstreamLocalAddress,
    UpstreamLocalAddressWithoutPort,
    UpstreamLocalPort,
    UpstreamTransportFailureReason,
    UpstreamPeerUriSan,
    UpstreamLocalUriSan,
    DownstreamPeerUriSan,
    DownstreamLocalUriSan,
    DownstreamPeerDnsSan,
    DownstreamPeerSubject,
    DownstreamTlsVersion,
    /// `%ENVIRONMENT(NAME)%`, read when the format is compiled (as Envoy does).
    Environment(Option<String>),
    UniqueId,
}

/// What a format string is rendered against.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub connection: &'a Connection,
    /// The HTTP stream's own filter state (the connection's is read below it).
    pub stream_filter_state: Option<&'a FilterState>,
    pub request: Option<Request<'a>>,
    /// The finished request's or connection's access-log entry.
    pub entry: Option<&'a Entry>,
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
            entry: None,
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
            let (name, alternative) = header_argument(command, arg)?;
            Operator::Request(name, alternative)
        }
        "REQ_WITHOUT_QUERY" => {
            let (name, alternative) = header_argument(command, arg)?;
            Operator::RequestWithoutQuery(name, alternative)
        }
        "RESP" => {
            let (name, alternative) = header_argument(command, arg)?;
            Operator::Response(name, alternative)
        }
        "START_TIME" => Operator::StartTime(match arg {
            None | Some("") => None,
            Some(format) => Some(TimeFormat::parse(format)?),
        }),
        "RESPONSE_CODE" => no_arg(Operator::ResponseCode)?,
        "RESPONSE_CODE_DETAILS" => no_arg(Operator::ResponseCodeDetails)?,
        "RESPONSE_FLAGS" => no_arg(Operator::ResponseFlags)?,
        "ROUTE_NAME" => no_arg(Operator::RouteName)?,
        "CONNECTION_TERMINATION_DETAILS" => no_arg(Operator::ConnectionTerminationDetails)?,
        "BYTES_RECEIVED" => no_arg(Operator::BytesReceived)?,
        "BYTES_SENT" => no_arg(Operator::BytesSent)?,
        "DURATION" => no_arg(Operator::Duration)?,
        "UPSTREAM_HOST" | "UPSTREAM_REMOTE_ADDRESS" => no_arg(Operator::UpstreamHost)?,
        "UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT" => {
            no_arg(Operator::UpstreamRemoteAddressWithoutPort)?
        }
        "UPSTREAM_REMOTE_PORT" => no_arg(Operator::UpstreamRemotePort)?,
        "UPSTREAM_CLUSTER" | "UPSTREAM_CLUSTER_RAW" => no_arg(Operator::UpstreamCluster)?,
        "UPSTREAM_LOCAL_ADDRESS" => no_arg(Operator::UpstreamLocalAddress)?,
        "UPSTREAM_LOCAL_ADDRESS_WITHOUT_PORT" => no_arg(Operator::UpstreamLocalAddressWithoutPort)?,
        "UPSTREAM_LOCAL_PORT" => no_arg(Operator::UpstreamLocalPort)?,
        "UPSTREAM_TRANSPORT_FAILURE_REASON" => no_arg(Operator::UpstreamTransportFailureReason)?,
        "UPSTREAM_PEER_URI_SAN" => no_arg(Operator::UpstreamPeerUriSan)?,
        "UPSTREAM_LOCAL_URI_SAN" => no_arg(Operator::UpstreamLocalUriSan)?,
        "DOWNSTREAM_PEER_URI_SAN" => no_arg(Operator::DownstreamPeerUriSan)?,
        "DOWNSTREAM_LOCAL_URI_SAN" => no_arg(Operator::DownstreamLocalUriSan)?,
        "DOWNSTREAM_PEER_DNS_SAN" => no_arg(Operator::DownstreamPeerDnsSan)?,
        "DOWNSTREAM_PEER_SUBJECT" => no_arg(Operator::DownstreamPeerSubject)?,
        "DOWNSTREAM_TLS_VERSION" => no_arg(Operator::DownstreamTlsVersion)?,
        "ENVIRONMENT" => {
            let name = arg
                .filter(|n| !n.is_empty())
                .ok_or("ENVIRONMENT needs a variable name: %ENVIRONMENT(NAME)%")?;
            Operator::Environment(std::env::var(name).ok())
        }
        "UNIQUE_ID" => no_arg(Operator::UniqueId)?,
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
            Operator::RequestWithoutQuery(name, alternative) => {
                let request = ctx.request?;
                let mut value = request_header(&request, name)
                    .or_else(|| request_header(&request, alternative.as_deref()?))?;
                if let Some(query) = value.find('?') {
                    value.truncate(query);
                }
                return Some(value);
            }
            Operator::Response(name, alternative) => {
                let headers = ctx.entry?.http.as_ref()?.response_headers.as_ref()?;
                let get = |name: &str| {
                    headers
                        .get(name)
                        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                };
                return get(name).or_else(|| get(alternative.as_deref()?));
            }
            Operator::Environment(value) => return value.clone(),
            Operator::UniqueId => return Some(unique_id()),
            Operator::DownstreamPeerUriSan => return joined(&c.tls.as_ref()?.peer_uri_sans),
            Operator::DownstreamLocalUriSan => return joined(&c.tls.as_ref()?.local_uri_sans),
            Operator::DownstreamPeerDnsSan => return joined(&c.tls.as_ref()?.peer_dns_sans),
            Operator::DownstreamPeerSubject => return c.tls.as_ref()?.peer_subject.clone(),
            Operator::DownstreamTlsVersion => {
                return c.tls.as_ref()?.version.map(str::to_owned);
            }
            entry_operator => return entry_operator.entry_value(ctx.entry?),
        }
        Some(out)
    }

    /// The commands read from the finished request's or connection's entry.
    fn entry_value(&self, entry: &Entry) -> Option<String> {
        let http = entry.http.as_deref();
        let text = |v: &dyn std::fmt::Display| Some(v.to_string());
        match self {
            Operator::StartTime(format) => Some(match format {
                None => TimeFormat::default_text(entry.start_time()),
                Some(format) => format.render(entry.start_time()),
            }),
            // Envoy's TCP lines and a request without a response log 0.
            Operator::ResponseCode => text(&http.map_or(0, |h| h.response_code)),
            Operator::ResponseCodeDetails => http?.response_code_details.clone(),
            Operator::ResponseFlags => Some(entry.response_flags_string()),
            Operator::RouteName => http?.route_name.as_deref().map(str::to_owned),
            Operator::ConnectionTerminationDetails => None,
            Operator::BytesReceived => text(&entry.bytes_received),
            Operator::BytesSent => text(&entry.bytes_sent),
            Operator::Duration => text(&entry.duration().as_millis()),
            Operator::UpstreamHost => text(&entry.upstream_host?),
            Operator::UpstreamRemoteAddressWithoutPort => text(&entry.upstream_host?.ip()),
            Operator::UpstreamRemotePort => text(&entry.upstream_host?.port()),
            Operator::UpstreamCluster => entry.upstream_cluster.as_deref().map(str::to_owned),
            Operator::UpstreamLocalAddress => text(&entry.upstream_local_address?),
            Operator::UpstreamLocalAddressWithoutPort => text(&entry.upstream_local_address?.ip()),
            Operator::UpstreamLocalPort => text(&entry.upstream_local_address?.port()),
            Operator::UpstreamTransportFailureReason => {
                entry.upstream_transport_failure_reason.clone()
            }
            Operator::UpstreamPeerUriSan => joined(&entry.upstream_peer_uri_sans),
            Operator::UpstreamLocalUriSan => joined(&entry.upstream_local_uri_sans),
            _ => None,
        }
    }
}

/// Several SANs as Envoy writes them: joined by commas; none is no value.
fn joined(values: &[String]) -> Option<String> {
    (!values.is_empty()).then(|| values.join(","))
}

/// Envoy's `%UNIQUE_ID%`: a random (version 4) UUID.
fn unique_id() -> String {
    let mut bytes = [0u8; 16];
    fill_random(&mut bytes);
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

fn fill_random(out: &mut [u8]) {
    use std::io::Read as _;
    if let Ok(mut urandom) = std::fs::File::open("/dev/urandom")
        && urandom.read_exact(out).is_ok()
    {
        return;
    }
    // No /dev/urandom: the clock's nanoseconds, mixed (an id, not a secret).
    let mut seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    for byte in out {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        *byte = seed as u8;
    }
}

/// A `%START_TIME(...)%` format: Envoy's strftime specifiers (UTC), with its own
/// `%E<n>S` (seconds with `n` fractional digits), `%<n>f` (the fraction alone) and
/// `%s` (seconds since the epoch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimeFormat(Vec<TimePiece>);

#[derive(Debug, Clone, PartialEq, Eq)]
enum TimePiece {
    Text(String),
    /// A strftime conversion character.
    Field(char),
    /// `%E<n>S`: seconds and `n` digits of fraction.
    SecondsWithFraction(usize),
    /// `%<n>f`: `n` digits of fraction (`%f`: 9).
    Fraction(usize),
}

impl TimeFormat {
    /// Parses `text`; an unknown specifier is an error naming it.
    pub fn parse(text: &str) -> Result<TimeFormat, String> {
        let mut pieces = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c != '%' {
                literal.push(c);
                continue;
            }
            let mut digits = String::new();
            while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                digits.push(*d);
                chars.next();
            }
            let spec = chars
                .next()
                .ok_or_else(|| format!("{text:?}: a '%' at the end of the time format"))?;
            let piece = match (spec, digits.as_str()) {
                ('%', "") => {
                    literal.push('%');
                    continue;
                }
                ('E', "") => {
                    let mut n = String::new();
                    while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit() || **d == '*') {
                        n.push(*d);
                        chars.next();
                    }
                    if chars.next() != Some('S') {
                        return Err(format!("{text:?}: %E must be %E<n>S"));
                    }
                    let n = if n == "*" {
                        9
                    } else {
                        n.parse().unwrap_or(0).min(9)
                    };
                    TimePiece::SecondsWithFraction(n)
                }
                ('f', n) => TimePiece::Fraction(if n.is_empty() {
                    9
                } else {
                    n.parse::<usize>().unwrap_or(9).min(9)
                }),
                (
                    'Y' | 'm' | 'd' | 'H' | 'M' | 'S' | 's' | 'z' | 'Z' | 'j' | 'y' | 'e' | 'a'
                    | 'b' | 'F' | 'T' | 'D' | 'R' | 'p' | 'I' | 'u' | 'w' | 'n' | 't',
                    "",
                ) => TimePiece::Field(spec),
                (other, _) => {
                    return Err(format!(
                        "{text:?}: the time specifier %{digits}{other} is not implemented by shunt"
                    ));
                }
            };
            if !literal.is_empty() {
                pieces.push(TimePiece::Text(std::mem::take(&mut literal)));
            }
            pieces.push(piece);
        }
        if !literal.is_empty() {
            pieces.push(TimePiece::Text(literal));
        }
        Ok(TimeFormat(pieces))
    }

    /// Envoy's default `%START_TIME%`: `2024-05-01T12:34:56.789Z`.
    pub fn default_text(time: SystemTime) -> String {
        let format = TimeFormat(vec![
            TimePiece::Field('F'),
            TimePiece::Text("T".into()),
            TimePiece::Field('H'),
            TimePiece::Text(":".into()),
            TimePiece::Field('M'),
            TimePiece::Text(":".into()),
            TimePiece::SecondsWithFraction(3),
            TimePiece::Text("Z".into()),
        ]);
        format.render(time)
    }

    pub fn render(&self, time: SystemTime) -> String {
        let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs() as i64;
        let nanos = since.subsec_nanos();
        let civil = Civil::from_unix(secs);
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                TimePiece::Text(text) => out.push_str(text),
                TimePiece::SecondsWithFraction(n) => {
                    let _ = write!(out, "{:02}", civil.second);
                    if *n > 0 {
                        let _ = write!(out, ".{}", &format!("{nanos:09}")[..*n]);
                    }
                }
                TimePiece::Fraction(n) => out.push_str(&format!("{nanos:09}")[..*n]),
                TimePiece::Field(c) => civil.field(*c, secs, &mut out),
            }
        }
        out
    }
}

/// A UTC calendar time.
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 is Sunday.
    weekday: u32,
    yday: u32,
}

impl Civil {
    /// Howard Hinnant's days-to-civil.
    fn from_unix(secs: i64) -> Civil {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        let year = yoe + era * 400 + i64::from(month <= 2);
        let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
        const BEFORE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
        let yday = BEFORE[month as usize - 1] + day + u32::from(leap && month > 2);
        Civil {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            weekday: (days + 4).rem_euclid(7) as u32,
            yday,
        }
    }

    fn field(&self, c: char, unix: i64, out: &mut String) {
        const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];
        const MONTHS: [&str; 12] = [
            "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
        ];
        let _ = match c {
            'Y' => write!(out, "{}", self.year),
            'y' => write!(out, "{:02}", self.year % 100),
            'm' => write!(out, "{:02}", self.month),
            'd' => write!(out, "{:02}", self.day),
            'e' => write!(out, "{:2}", self.day),
            'H' => write!(out, "{:02}", self.hour),
            'I' => write!(out, "{:02}", (self.hour + 11) % 12 + 1),
            'p' => write!(out, "{}", if self.hour < 12 { "AM" } else { "PM" }),
            'M' => write!(out, "{:02}", self.minute),
            'S' => write!(out, "{:02}", self.second),
            's' => write!(out, "{unix}"),
            'z' => write!(out, "+0000"),
            'Z' => write!(out, "UTC"),
            'j' => write!(out, "{:03}", self.yday),
            'a' => write!(out, "{}", DAYS[self.weekday as usize]),
            'b' => write!(out, "{}", MONTHS[self.month as usize - 1]),
            'u' => write!(out, "{}", if self.weekday == 0 { 7 } else { self.weekday }),
            'w' => write!(out, "{}", self.weekday),
            'F' => write!(out, "{}-{:02}-{:02}", self.year, self.month, self.day),
            'T' => write!(
                out,
                "{:02}:{:02}:{:02}",
                self.hour, self.minute, self.second
            ),
            'R' => write!(out, "{:02}:{:02}", self.hour, self.minute),
            'D' => write!(
                out,
                "{:02}/{:02}/{:02}",
                self.month,
                self.day,
                self.year % 100
            ),
            'n' => {
                out.push('\n');
                Ok(())
            }
            't' => {
                out.push('\t');
                Ok(())
            }
            _ => Ok(()),
        };
    }
}

/// `%REQ(name?alternative)%`'s argument, lowercased.
fn header_argument(command: &str, arg: Option<&str>) -> Result<(String, Option<String>), String> {
    let arg = arg.ok_or_else(|| format!("{command} needs a header name: %{command}(name)%"))?;
    let (name, alternative) = match arg.split_once('?') {
        Some((a, b)) => (a, Some(b.to_ascii_lowercase())),
        None => (arg, None),
    };
    if name.is_empty() {
        return Err(format!("{command} needs a header name"));
    }
    Ok((name.to_ascii_lowercase(), alternative))
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
            entry: None,
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
    fn renders_a_finished_request_from_its_entry() {
        use crate::access_log::{Direction, HttpFields, ResponseFlag};
        use crate::stream_info::Tls;
        let mut connection = Connection::new(
            "10.0.0.1:8080".parse().unwrap(),
            "10.0.0.2:5000".parse().unwrap(),
        );
        connection.tls = Some(Arc::new(Tls {
            peer_certificate_presented: true,
            peer_uri_sans: vec!["spiffe://td/ns/a/sa/client".into()],
            local_uri_sans: vec!["spiffe://td/ns/b/sa/server".into()],
            peer_subject: Some("CN=client".into()),
            version: Some("TLSv1.3"),
            ..Default::default()
        }));
        let mut entry = Entry::start(Direction::Inbound, connection.remote, connection.local);
        entry.upstream_host = Some("10.0.0.9:80".parse().unwrap());
        entry.upstream_cluster = Some("inbound|80||".into());
        entry.bytes_received = 12;
        entry.bytes_sent = 345;
        entry.flag(ResponseFlag::UpstreamRequestTimeout);
        entry.upstream_peer_uri_sans = vec!["spiffe://td/ns/c/sa/up".into()];
        let mut response_headers = HeaderMap::new();
        response_headers.insert("content-type", "text/plain".parse().unwrap());
        entry.http = Some(Box::new(HttpFields {
            response_code: 504,
            route_name: Some("default".into()),
            response_code_details: Some("upstream_response_timeout".into()),
            response_headers: Some(response_headers),
            ..Default::default()
        }));
        let ctx = Context {
            connection: &connection,
            stream_filter_state: None,
            request: None,
            entry: Some(&entry),
        };
        let render = |text: &str| format(text).render(&ctx);
        assert_eq!(
            render("%RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% %ROUTE_NAME%"),
            "504 UT upstream_response_timeout default"
        );
        assert_eq!(
            render("%BYTES_RECEIVED% %BYTES_SENT% %UPSTREAM_HOST% %UPSTREAM_CLUSTER_RAW%"),
            "12 345 10.0.0.9:80 inbound|80||"
        );
        assert_eq!(
            render(
                "%UPSTREAM_REMOTE_ADDRESS_WITHOUT_PORT% %UPSTREAM_LOCAL_ADDRESS% %CONNECTION_TERMINATION_DETAILS%"
            ),
            "10.0.0.9 - -"
        );
        assert_eq!(
            render(
                "%DOWNSTREAM_PEER_URI_SAN% %DOWNSTREAM_LOCAL_URI_SAN% %DOWNSTREAM_PEER_SUBJECT% %DOWNSTREAM_TLS_VERSION%"
            ),
            "spiffe://td/ns/a/sa/client spiffe://td/ns/b/sa/server CN=client TLSv1.3"
        );
        assert_eq!(
            render("%UPSTREAM_PEER_URI_SAN% %RESP(content-type)% %RESP(x-none)%"),
            "spiffe://td/ns/c/sa/up text/plain -"
        );
        assert!(render("%DURATION%").parse::<u64>().is_ok());
        let id = render("%UNIQUE_ID%");
        assert_eq!((id.len(), id.as_bytes()[14]), (36, b'4'), "{id}");
        // Without a finished entry (set_filter_state) they have no value.
        assert_eq!(
            format("%RESPONSE_CODE%").render(&Context::connection(&connection)),
            "-"
        );
    }

    #[test]
    fn start_time_formats_are_envoys() {
        // 2000-02-29T01:02:03.123456789Z, a Tuesday.
        let time = UNIX_EPOCH + std::time::Duration::new(951_786_123, 123_456_789);
        let render = |f: &str| TimeFormat::parse(f).unwrap().render(time);
        assert_eq!(TimeFormat::default_text(time), "2000-02-29T01:02:03.123Z");
        assert_eq!(render("%Y/%m/%dT%H:%M:%S%z"), "2000/02/29T01:02:03+0000");
        assert_eq!(
            render("%s.%3f %E6S %j %a %b %F %T %%"),
            "951786123.123 03.123456 060 Tue Feb 2000-02-29 01:02:03 %"
        );
        assert!(
            TimeFormat::parse("%Q")
                .unwrap_err()
                .contains("%Q is not implemented")
        );
        let mut problems = Diagnostics::default();
        assert!(Format::compile("%START_TIME(%Q)%", &JsonPath::new("f"), &mut problems).is_none());
        assert!(Format::compile("%ENVIRONMENT()%", &JsonPath::new("f"), &mut problems).is_none());
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
