//! One access log line per connection, as JSON on stdout, in Envoy's vocabulary.
//!
//! The line is written when the connection ends, so it carries the byte counts, the
//! duration and the response flags. Field names follow Envoy's command operators
//! (`%DOWNSTREAM_REMOTE_ADDRESS%` becomes `downstream_remote_address`); a value that is
//! not known (no upstream was chosen, say) is `null`, as in Envoy's JSON format.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::config::accesslog::v3::{AccessLog, access_log};
use envoy_types::pb::envoy::extensions::access_loggers::file::v3::FileAccessLog;
use serde::Serialize;

use shunt_config::convert::{self, decode};
use shunt_config::{Diagnostics, JsonPath};

use crate::stream_info::Connection;
pub use crate::stream_info::ResponseFlag;

/// Which listener accepted the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Captured on the outbound port (15001): the app is the client.
    Outbound,
    /// Captured on the inbound port (15006): the app is the server.
    Inbound,
    /// A bootstrap listener without `traffic_direction`.
    Unspecified,
}

impl std::fmt::Display for Direction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
            Self::Unspecified => "unspecified",
        })
    }
}

/// What one connection did, gathered while it runs and written once when it ends.
#[derive(Debug)]
pub struct Entry {
    /// Monotonic: the wall-clock start is derived from it when a line is written, so
    /// an entry costs one clock read (none when its stream already read one).
    start: Instant,
    pub direction: Direction,
    pub downstream_remote_address: SocketAddr,
    pub downstream_local_address: SocketAddr,
    pub original_dst: Option<SocketAddr>,
    pub upstream_cluster: Option<Arc<str>>,
    /// The upstream cluster's `metadata` (not logged: Istio's stats read its
    /// `istio.services`).
    pub upstream_cluster_metadata: Option<Arc<crate::interned::EncodedMetadata>>,
    pub upstream_host: Option<SocketAddr>,
    pub upstream_local_address: Option<SocketAddr>,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub response_flags: Vec<ResponseFlag>,
    /// Why the upstream TLS handshake failed (Envoy's
    /// `%UPSTREAM_TRANSPORT_FAILURE_REASON%`); left out when there was none.
    pub upstream_transport_failure_reason: Option<String>,
    /// The upstream TLS session's URI SANs: the server's (Envoy's
    /// `%UPSTREAM_PEER_URI_SAN%`) and those of the certificate shunt presented
    /// (`%UPSTREAM_LOCAL_URI_SAN%`). Not logged: Istio's client-side stats read them.
    pub upstream_peer_uri_sans: Vec<String>,
    pub upstream_local_uri_sans: Vec<String>,
    /// The HTTP/1.1 wire size of the request's head as received and of the response's
    /// head (and chunk framing) as sent: with the body bytes, Istio's request and
    /// response sizes. Not logged.
    pub request_head_bytes: u64,
    pub response_head_bytes: u64,
    /// Set for the line of one HTTP request (the HTTP connection manager writes one per
    /// request); TCP lines leave it out.
    pub http: Option<Box<HttpFields>>,
    /// The downstream connection (TLS peer, SNI, filter state), for the loggers that
    /// read more than the JSON line (gRPC and OpenTelemetry services, filters). Not
    /// logged.
    pub connection: Option<Arc<Connection>>,
}

/// What an HTTP request adds to its line, named as Istio's JSON access log names
/// Envoy's command operators (`%REQ(:METHOD)%` is `method`, `%REQ(X-REQUEST-ID)%` is
/// `request_id`).
#[derive(Debug, Default, Serialize)]
pub struct HttpFields {
    pub method: String,
    /// As the downstream sent it (before any rewrite), query included.
    pub path: String,
    /// `HTTP/1.1`, `HTTP/2`.
    pub protocol: &'static str,
    /// 0 until a response is chosen (the downstream went away before).
    pub response_code: u16,
    pub authority: Option<String>,
    pub request_id: Option<String>,
    pub user_agent: Option<String>,
    /// Envoy's `%RESPONSE_CODE_DETAILS%` (`via_upstream` for an upstream's response),
    /// when known. Not logged.
    #[serde(skip)]
    pub response_code_details: Option<String>,
    /// The name of the route that served the request (`%ROUTE_NAME%`). Not logged.
    #[serde(skip)]
    pub route_name: Option<Arc<str>>,
    /// `http` or `https`. Not logged.
    #[serde(skip)]
    pub scheme: &'static str,
    /// The request's and the response's headers, copied only when a configured logger
    /// reads them ([`Sink::wants_headers`]). Not logged.
    #[serde(skip)]
    pub request_headers: Option<hyper::HeaderMap>,
    #[serde(skip)]
    pub response_headers: Option<hyper::HeaderMap>,
}

/// The line as serialized: field order here is the order on the wire.
#[derive(Serialize)]
struct Line<'a> {
    start_time: String,
    direction: Direction,
    downstream_remote_address: SocketAddr,
    downstream_local_address: SocketAddr,
    original_dst: Option<SocketAddr>,
    upstream_cluster: Option<&'a str>,
    upstream_host: Option<SocketAddr>,
    upstream_local_address: Option<SocketAddr>,
    bytes_received: u64,
    bytes_sent: u64,
    duration_ms: u64,
    response_flags: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    upstream_transport_failure_reason: Option<&'a str>,
    #[serde(flatten)]
    http: Option<&'a HttpFields>,
}

impl Entry {
    /// Starts the clock for a connection just accepted.
    pub fn start(direction: Direction, remote: SocketAddr, local: SocketAddr) -> Self {
        Self::started_at(direction, remote, local, Instant::now())
    }

    /// An entry whose clock started at `start` (a stream's own start: one clock read
    /// serves both).
    pub fn started_at(
        direction: Direction,
        remote: SocketAddr,
        local: SocketAddr,
        start: Instant,
    ) -> Self {
        Self {
            start,
            direction,
            downstream_remote_address: remote,
            downstream_local_address: local,
            original_dst: None,
            upstream_cluster: None,
            upstream_cluster_metadata: None,
            upstream_host: None,
            upstream_local_address: None,
            bytes_received: 0,
            bytes_sent: 0,
            response_flags: Vec::new(),
            upstream_transport_failure_reason: None,
            upstream_peer_uri_sans: Vec::new(),
            upstream_local_uri_sans: Vec::new(),
            request_head_bytes: 0,
            response_head_bytes: 0,
            http: None,
            connection: None,
        }
    }

    pub fn flag(&mut self, flag: ResponseFlag) {
        if !self.response_flags.contains(&flag) {
            self.response_flags.push(flag);
        }
    }

    /// How long the connection or request has lasted, now.
    pub fn duration(&self) -> Duration {
        self.start.elapsed()
    }

    /// The wall-clock time the connection or request began (Envoy's `start_time`).
    pub fn start_time(&self) -> SystemTime {
        SystemTime::now()
            .checked_sub(self.duration())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// Envoy's `%RESPONSE_FLAGS%`: `-` for none, else the codes joined by commas.
    pub fn response_flags_string(&self) -> String {
        flags_string(&self.response_flags)
    }

    /// Renders the entry as one JSON line (with its newline), taking the duration now.
    pub fn to_line(&self) -> Vec<u8> {
        let duration = self.start.elapsed();
        let start_wall = SystemTime::now()
            .checked_sub(duration)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let line = Line {
            start_time: rfc3339_millis(start_wall),
            direction: self.direction,
            downstream_remote_address: self.downstream_remote_address,
            downstream_local_address: self.downstream_local_address,
            original_dst: self.original_dst,
            upstream_cluster: self.upstream_cluster.as_deref(),
            upstream_host: self.upstream_host,
            upstream_local_address: self.upstream_local_address,
            bytes_received: self.bytes_received,
            bytes_sent: self.bytes_sent,
            duration_ms: u64::try_from(duration.as_millis()).unwrap_or(u64::MAX),
            response_flags: flags_string(&self.response_flags),
            upstream_transport_failure_reason: self.upstream_transport_failure_reason.as_deref(),
            http: self.http.as_deref(),
        };
        // Serializing plain strings and numbers into a Vec cannot fail.
        let mut out = serde_json::to_vec(&line).unwrap_or_default();
        out.push(b'\n');
        out
    }

    /// Writes the line to stdout and flushes it, so a reader sees each connection as
    /// soon as it ends. One `write_all` under the lock keeps lines from interleaving.
    pub fn emit(&self) {
        Sink::Stdout.write(&self.to_line());
    }

    /// Writes the entry to each of a filter's configured access logs (none: no line).
    /// The JSON line is rendered once, for the first sink that writes it.
    pub fn emit_to(&self, sinks: &[Sink]) {
        let mut line = None;
        for sink in sinks {
            match sink {
                Sink::Service(service) => service.log(self),
                _ => sink.write(line.get_or_insert_with(|| self.to_line())),
            }
        }
    }
}

/// An access logger other than a stream or file: a gRPC or OpenTelemetry log service,
/// or any sink behind an access-log `filter`. Implemented above this crate (the
/// services need clusters); `log` must not block the request path.
pub trait ServiceSink: std::fmt::Debug + Send + Sync {
    fn log(&self, entry: &Entry);
    /// Whether the logger reads the request's and response's headers (they are copied
    /// into the entry for it).
    fn wants_headers(&self) -> bool;
}

/// Where a configured access log goes: Envoy's `StdoutAccessLog` / `StderrAccessLog`, or
/// a `FileAccessLog` path. The line is always ours (the JSON above), whatever format the
/// config asks for.
#[derive(Debug, Clone)]
pub enum Sink {
    Stdout,
    Stderr,
    File(Arc<FileSink>),
    Service(Arc<dyn ServiceSink>),
}

#[derive(Debug)]
pub struct FileSink {
    pub path: PathBuf,
    file: Mutex<std::fs::File>,
}

impl Sink {
    /// Opens `path` for appending; `/dev/stdout` and `/dev/stderr` are the streams.
    pub fn open(path: &Path) -> std::io::Result<Sink> {
        if path == Path::new("/dev/stdout") {
            return Ok(Sink::Stdout);
        }
        if path == Path::new("/dev/stderr") {
            return Ok(Sink::Stderr);
        }
        let file = open_append(path)?;
        let sink = Arc::new(FileSink {
            path: path.to_owned(),
            file: Mutex::new(file),
        });
        let mut open = OPEN_FILES.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|weak| weak.strong_count() > 0);
        open.push(Arc::downgrade(&sink));
        Ok(Sink::File(sink))
    }

    /// Whether this sink reads the entry's headers.
    pub fn wants_headers(&self) -> bool {
        matches!(self, Sink::Service(service) if service.wants_headers())
    }

    /// Writes one already rendered line (a formatted entry) to a stream or file.
    pub fn write_line(&self, line: &[u8]) {
        self.write(line);
    }

    /// Logs one entry (a stream or file gets the JSON line).
    pub fn log(&self, entry: &Entry) {
        match self {
            Sink::Service(service) => service.log(entry),
            _ => self.write(&entry.to_line()),
        }
    }

    fn write(&self, line: &[u8]) {
        let result = match self {
            Sink::Service(_) => Ok(()),
            Sink::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(line).and_then(|()| out.flush())
            }
            Sink::Stderr => std::io::stderr().lock().write_all(line),
            // O_APPEND and one write per line: lines never interleave.
            Sink::File(file) => file
                .file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write_all(line),
        };
        if let Err(err) = result {
            match self {
                Sink::File(file) => {
                    tracing::debug!(path = %file.path.display(), %err, "access log write failed");
                }
                _ => tracing::debug!(%err, "access log write failed"),
            }
        }
    }
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// Every file access log still in use, for [`reopen_files`].
static OPEN_FILES: Mutex<Vec<std::sync::Weak<FileSink>>> = Mutex::new(Vec::new());

/// Envoy's SIGUSR1: closes and reopens every file access log at its configured path,
/// so after logrotate's `mv`, lines go to a new file at the path (and not on into the
/// renamed one). A path that cannot be opened keeps its old file, with a warning.
/// Returns how many files were reopened.
pub fn reopen_files() -> usize {
    let sinks: Vec<Arc<FileSink>> = {
        let mut open = OPEN_FILES.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|weak| weak.strong_count() > 0);
        open.iter().filter_map(std::sync::Weak::upgrade).collect()
    };
    let mut reopened = 0;
    for sink in sinks {
        match open_append(&sink.path) {
            Ok(file) => {
                *sink.file.lock().unwrap_or_else(|e| e.into_inner()) = file;
                reopened += 1;
            }
            Err(err) => {
                tracing::warn!(path = %sink.path.display(), %err, "reopening an access log failed; writing on to the old file");
            }
        }
    }
    reopened
}

/// Envoy joins several flags with commas and writes `-` for none.
pub fn flags_string(flags: &[ResponseFlag]) -> String {
    if flags.is_empty() {
        return "-".to_owned();
    }
    flags
        .iter()
        .map(|flag| flag.code())
        .collect::<Vec<_>>()
        .join(",")
}

/// `2024-05-01T12:34:56.789Z`, the form Envoy's `%START_TIME%` takes. A wall clock set
/// wrong shows as the nearest time RFC 3339 can (1970 to 9999) rather than panicking.
fn rfc3339_millis(time: SystemTime) -> String {
    let last = UNIX_EPOCH + Duration::new(253_402_300_799, 999_000_000);
    humantime::format_rfc3339_millis(time.clamp(UNIX_EPOCH, last)).to_string()
}

const FILE: &str = "envoy.extensions.access_loggers.file.v3.FileAccessLog";
const STDOUT: &str = "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog";
const STDERR: &str = "envoy.extensions.access_loggers.stream.v3.StderrAccessLog";

/// The access loggers [`compile`] opens: config validation's list of them.
pub const ACCESS_LOGGERS: &[&str] = &[FILE, STDOUT, STDERR];

/// What [`builtin`] made of an access logger's `typed_config`.
pub enum Builtin {
    Opened(Sink),
    /// A built-in logger whose config is wrong (the error is in `problems`).
    Failed,
    /// Not a stream or file logger: the caller's to compile.
    Other,
}

/// Opens a stream or file access logger from its `typed_config` (at `typed_path`).
/// Each writes shunt's JSON line whatever format it asks for.
pub fn builtin(
    any: &envoy_types::pb::google::protobuf::Any,
    typed_path: &JsonPath,
    problems: &mut Diagnostics,
) -> Builtin {
    match convert::type_name(any) {
        FILE => {
            let Some(file) = decode::<FileAccessLog>(any, typed_path, problems) else {
                return Builtin::Failed;
            };
            if file.access_log_format.is_some() {
                problems.warning(
                    typed_path.field("access_log_format"),
                    "custom formats are not implemented; shunt writes its JSON line",
                );
            }
            match Sink::open(Path::new(&file.path)) {
                Ok(sink) => Builtin::Opened(sink),
                Err(err) => {
                    problems.error(
                        typed_path.field("path"),
                        format!("cannot open {:?}: {err}", file.path),
                    );
                    Builtin::Failed
                }
            }
        }
        STDOUT => Builtin::Opened(Sink::Stdout),
        STDERR => Builtin::Opened(Sink::Stderr),
        _ => Builtin::Other,
    }
}

/// Opens the access logs shunt can write without a service: files, stdout and stderr
/// (filters are not read here; `shunt_filters::common::access_log` compiles them and
/// the log services).
pub fn compile(logs: &[AccessLog], path: &JsonPath, problems: &mut Diagnostics) -> Vec<Sink> {
    let mut sinks = Vec::new();
    for (i, log) in logs.iter().enumerate() {
        let log_path = path.index(i);
        let Some(access_log::ConfigType::TypedConfig(any)) = &log.config_type else {
            problems.warning(&log_path, "an access log without typed_config is ignored");
            continue;
        };
        let typed_path = log_path.field("typed_config");
        match builtin(any, &typed_path, problems) {
            Builtin::Opened(sink) => sinks.push(sink),
            Builtin::Failed => {}
            Builtin::Other => problems.warning(
                &typed_path,
                format!(
                    "access logger {} is not implemented; ignored",
                    convert::type_name(any)
                ),
            ),
        }
    }
    sinks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_is_rfc3339_utc_with_millis() {
        assert_eq!(rfc3339_millis(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let leap_day = UNIX_EPOCH + Duration::from_millis(951_782_400_123 + 3_723_000);
        assert_eq!(rfc3339_millis(leap_day), "2000-02-29T01:02:03.123Z");
        let new_year = UNIX_EPOCH + Duration::from_secs(1_735_689_599);
        assert_eq!(rfc3339_millis(new_year), "2024-12-31T23:59:59.000Z");
        let before = UNIX_EPOCH - Duration::from_secs(1);
        assert_eq!(rfc3339_millis(before), "1970-01-01T00:00:00.000Z");
        let far = UNIX_EPOCH + Duration::from_secs(300_000_000_000);
        assert_eq!(rfc3339_millis(far), "9999-12-31T23:59:59.999Z");
    }

    #[test]
    fn a_failed_outbound_connection_logs_one_json_line_with_envoy_names() {
        let mut entry = Entry::start(
            Direction::Outbound,
            "10.0.0.5:40000".parse().unwrap(),
            "127.0.0.1:15001".parse().unwrap(),
        );
        entry.original_dst = Some("[2001:db8::1]:80".parse().unwrap());
        entry.upstream_cluster = Some("PassthroughCluster".into());
        entry.upstream_host = entry.original_dst;
        entry.flag(ResponseFlag::UpstreamConnectionFailure);
        entry.flag(ResponseFlag::UpstreamConnectionFailure);

        let line = entry.to_line();
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(line.iter().filter(|&&b| b == b'\n').count(), 1);
        let json: serde_json::Value = serde_json::from_slice(&line).unwrap();
        assert_eq!(json["direction"], "outbound");
        assert_eq!(json["downstream_remote_address"], "10.0.0.5:40000");
        assert_eq!(json["downstream_local_address"], "127.0.0.1:15001");
        assert_eq!(json["original_dst"], "[2001:db8::1]:80");
        assert_eq!(json["upstream_cluster"], "PassthroughCluster");
        assert_eq!(json["upstream_host"], "[2001:db8::1]:80");
        assert!(json["upstream_local_address"].is_null());
        assert_eq!(json["bytes_received"], 0);
        assert_eq!(json["bytes_sent"], 0);
        assert!(json["duration_ms"].is_u64());
        assert_eq!(json["response_flags"], "UF");
    }

    #[test]
    fn reopening_after_a_rename_writes_to_a_new_file_at_the_path() {
        let dir = std::env::temp_dir().join(format!("shunt-reopen-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("access.log");
        let sink = Sink::open(&path).unwrap();
        sink.write(b"first\n");
        let rotated = dir.join("access.log.1");
        std::fs::rename(&path, &rotated).unwrap();
        sink.write(b"second\n");
        assert!(reopen_files() >= 1);
        sink.write(b"third\n");
        assert_eq!(
            std::fs::read_to_string(&rotated).unwrap(),
            "first\nsecond\n"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "third\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn no_flags_is_a_dash_and_several_are_comma_separated() {
        assert_eq!(flags_string(&[]), "-");
        assert_eq!(
            flags_string(&[
                ResponseFlag::UpstreamConnectionFailure,
                ResponseFlag::NoHealthyUpstream
            ]),
            "UF,UH"
        );
    }
}
