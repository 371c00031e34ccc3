//! The DNS proxy: Istio's agent DNS server (pilot-agent with `ISTIO_META_DNS_CAPTURE`),
//! where the pod's captured DNS queries land (127.0.0.1:15053 and [::1]:15053, UDP and
//! TCP).
//!
//! - [`name_table`]: the table istiod sends over xDS and the lookup built from it; the
//!   mesh's names are answered from it, authoritatively, with a 30 s TTL.
//! - [`upstream`]: everything else goes to the `resolv.conf` servers, TC answers again
//!   over TCP, UDP through one shared socket per server ([`udp_pool`]); [`cache`] keeps
//!   those answers for their TTL; [`in_flight`] bounds how many are forwarded at once
//!   (over the bound: SERVFAIL at once, counted).
//! - [`server`]: the UDP and TCP sockets (bound as root, before privileges drop) and
//!   their serve loops.
//!
//! Messages are parsed and written by hickory-proto. The table is an [`ArcSwapOption`]
//! owned here and set from above (the xDS manager), so an update applies to the next
//! query and a query in flight keeps the table it started with. Until the first table
//! arrives every query is answered SERVFAIL, as Istio's agent does on 15053.

#![forbid(unsafe_code)]

pub mod cache;
pub mod in_flight;
pub mod name_table;
pub mod server;
pub mod udp_pool;
pub mod upstream;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use envoy_types::pb::google::protobuf::Any;
use hickory_proto::op::{Header, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::RecordType;
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder};
use prost::Message as _;

use cache::{Cache, Key};
use in_flight::{InFlight, Permit};
use name_table::{Lookup, LookupTable, NameTable, Scope, TableError};
use shunt_core::stats::{Counter, Histogram, Store as StatsStore};
use udp_pool::{AnswerKey, UdpPool};
use upstream::Upstreams;

/// Istio's DNS proxy port.
pub const DEFAULT_PORT: u16 = 15053;

/// How the DNS proxy is set up (from flags, env and the bootstrap's node).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where to listen, UDP and TCP on each.
    pub listen: Vec<std::net::SocketAddr>,
    /// Whether `listen` is the default (an address that cannot be bound is skipped).
    pub default_listen: bool,
    pub resolv_conf: PathBuf,
    pub upstream_timeout: Duration,
    pub cache_capacity: usize,
    /// The pod's namespace and Istio's proxy DNS domain (`ns.svc.cluster.local`).
    pub namespace: String,
    pub domain: String,
}

/// A name table in use: as received (for `/config_dump`) and as looked up.
#[derive(Debug)]
pub struct Loaded {
    pub table: NameTable,
    pub lookup: LookupTable,
    pub version: String,
}

/// The current name table, shared by the serving side and whoever sets it (xDS).
#[derive(Debug)]
pub struct Tables {
    scope: Scope,
    current: ArcSwapOption<Loaded>,
}

impl Tables {
    pub fn new(scope: Scope) -> Tables {
        Tables {
            scope,
            current: ArcSwapOption::empty(),
        }
    }

    /// Builds the lookup for `table` and makes it current; a table that cannot be used
    /// leaves the current one in place.
    pub fn apply(&self, table: NameTable, version: &str) -> Result<(), TableError> {
        let lookup = LookupTable::build(&table, &self.scope)?;
        tracing::info!(
            version,
            hosts = table.table.len(),
            names = lookup.len(),
            "DNS name table applied"
        );
        self.current.store(Some(Arc::new(Loaded {
            table,
            lookup,
            version: version.to_owned(),
        })));
        Ok(())
    }

    pub fn current(&self) -> Option<Arc<Loaded>> {
        self.current.load_full()
    }

    /// The current table as an `Any`, for `/config_dump`.
    pub fn to_any(&self) -> Option<Any> {
        self.current().map(|loaded| Any {
            type_url: name_table::TYPE_URL.to_owned(),
            value: loaded.table.encode_to_vec(),
        })
    }

    pub fn scope(&self) -> &Scope {
        &self.scope
    }
}

/// The DNS proxy's counters, named after Istio's agent metrics (`dns_requests_total`,
/// `dns_upstream_requests_total`, `dns_upstream_failures_total`) plus ours.
#[derive(Clone)]
pub struct DnsStats {
    pub requests: Counter,
    pub answered_locally: Counter,
    pub upstream_requests: Counter,
    pub upstream_failures: Counter,
    pub nxdomain: Counter,
    pub cache_hits: Counter,
    pub upstream_tcp_retries: Counter,
    pub upstream_request_duration: Histogram,
    /// Queries answered SERVFAIL without forwarding: over the in-flight bound.
    pub upstream_shed: Counter,
}

impl DnsStats {
    pub fn new(store: &StatsStore) -> DnsStats {
        DnsStats {
            requests: store.counter("dns.requests_total"),
            answered_locally: store.counter("dns.answered_locally_total"),
            upstream_requests: store.counter("dns.upstream_requests_total"),
            upstream_failures: store.counter("dns.upstream_failures_total"),
            nxdomain: store.counter("dns.nxdomain_total"),
            cache_hits: store.counter("dns.cache_hits_total"),
            upstream_tcp_retries: store.counter("dns.upstream_tcp_retries_total"),
            upstream_request_duration: store.histogram("dns.upstream_request_duration_ms"),
            upstream_shed: store.counter("dns.upstream_shed_total"),
        }
    }
}

/// What [`Resolver::answer_now`] could do.
pub enum Step {
    /// The answer (or `None`: nothing to answer).
    Done(Option<Vec<u8>>),
    /// It needs an upstream: [`Resolver::forward`].
    Forward(Forward),
}

/// A query to forward upstream.
pub struct Forward {
    query: Message,
    key: Option<Key>,
    request: Vec<u8>,
    transport: Transport,
}

/// How a query came in: it decides the answer's size limit and the upstream transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Udp,
    Tcp,
}

/// Answers queries: from the table, the cache or upstream.
pub struct Resolver {
    pub tables: Arc<Tables>,
    upstreams: Upstreams,
    udp_pool: UdpPool,
    in_flight: Arc<InFlight>,
    cache: Cache,
    stats: DnsStats,
}

impl Resolver {
    pub fn new(
        tables: Arc<Tables>,
        upstreams: Upstreams,
        cache_capacity: usize,
        stats: DnsStats,
    ) -> Resolver {
        Resolver {
            tables,
            upstreams,
            udp_pool: UdpPool::default(),
            in_flight: InFlight::new(
                in_flight::MAX_IN_FLIGHT,
                in_flight::MAX_IN_FLIGHT_PER_CLIENT,
            ),
            cache: Cache::new(cache_capacity),
            stats,
        }
    }

    /// As [`Resolver::answer`] for a query from `client`, forwarded only within the
    /// in-flight bound (SERVFAIL over it).
    pub async fn answer_from(
        &self,
        request: &[u8],
        transport: Transport,
        client: std::net::IpAddr,
    ) -> Option<Vec<u8>> {
        match self.answer_now(request, transport) {
            Step::Done(reply) => reply,
            Step::Forward(forward) => match self.admit(client) {
                Some(_permit) => self.forward(forward).await,
                None => self.shed(forward),
            },
        }
    }

    /// A place in flight for one forwarded query from `client`, if there is one.
    pub fn admit(&self, client: std::net::IpAddr) -> Option<Permit> {
        self.in_flight.admit(client)
    }

    /// The answer to a query over the in-flight bound: SERVFAIL, counted.
    pub fn shed(&self, forward: Forward) -> Option<Vec<u8>> {
        self.stats.upstream_shed.inc();
        tracing::debug!("DNS query over the in-flight bound: SERVFAIL");
        let response = error_reply(&forward.query, ResponseCode::ServFail);
        self.finish(&forward.query, response, forward.transport)
    }

    /// Queries forwarded and not answered yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.total()
    }

    /// Upstream UDP sockets open now (one per resolver address used).
    pub fn upstream_sockets(&self) -> usize {
        self.udp_pool.len()
    }

    /// The answer to one query as it came on the wire, or `None` when there is nothing
    /// to answer (not a query, or not even a header).
    pub async fn answer(&self, request: &[u8], transport: Transport) -> Option<Vec<u8>> {
        match self.answer_now(request, transport) {
            Step::Done(reply) => reply,
            Step::Forward(forward) => self.forward(forward).await,
        }
    }

    /// Everything that needs no upstream: a local answer, a cached one, an error; or
    /// what to forward. The UDP loop answers these without a task of their own.
    pub fn answer_now(&self, request: &[u8], transport: Transport) -> Step {
        let query = match Message::from_vec(request) {
            Ok(query) => query,
            Err(error) => {
                // Enough of a header to say FORMERR to: say it.
                let Ok(header) = Header::read(&mut BinDecoder::new(request)) else {
                    return Step::Done(None);
                };
                if header.metadata.message_type != MessageType::Query {
                    return Step::Done(None);
                }
                tracing::debug!(%error, "a query that does not parse");
                let mut reply = Message::response(header.metadata.id, header.metadata.op_code);
                reply.metadata.response_code = ResponseCode::FormErr;
                return Step::Done(reply.to_vec().ok());
            }
        };
        if query.metadata.message_type != MessageType::Query {
            return Step::Done(None);
        }
        self.stats.requests.inc();
        let response = if query.metadata.op_code != OpCode::Query {
            error_reply(&query, ResponseCode::NotImp)
        } else {
            match self.resolve_now(&query) {
                Ok(response) => response,
                Err(key) => {
                    return Step::Forward(Forward {
                        query,
                        key,
                        request: request.to_vec(),
                        transport,
                    });
                }
            }
        };
        Step::Done(self.finish(&query, response, transport))
    }

    /// Sends `forward` upstream and answers with what comes back (SERVFAIL if nothing).
    pub async fn forward(&self, forward: Forward) -> Option<Vec<u8>> {
        let Forward {
            query,
            key,
            request,
            transport,
        } = forward;
        self.stats.upstream_requests.inc();
        let started = Instant::now();
        let result = self
            .upstreams
            .exchange(
                &self.udp_pool,
                &request,
                &AnswerKey::of(&query),
                transport == Transport::Tcp,
            )
            .await;
        self.stats
            .upstream_request_duration
            .record(started.elapsed().as_secs_f64() * 1000.0);
        let response = match result {
            Ok(answer) => {
                if answer.retried_over_tcp {
                    self.stats.upstream_tcp_retries.inc();
                }
                if let Some(key) = key {
                    self.cache.put(key, &answer.message);
                }
                answer.message
            }
            Err(errors) => {
                self.stats.upstream_failures.inc();
                if errors.is_empty() {
                    tracing::warn!("no upstream DNS server to forward to (resolv.conf has none)");
                }
                error_reply(&query, ResponseCode::ServFail)
            }
        };
        self.finish(&query, response, transport)
    }

    fn finish(&self, query: &Message, response: Message, transport: Transport) -> Option<Vec<u8>> {
        if response.metadata.response_code == ResponseCode::NXDomain {
            self.stats.nxdomain.inc();
        }
        encode(query, response, transport)
    }

    /// The answer from the table or the cache; else the cache key to forward under.
    fn resolve_now(&self, query: &Message) -> Result<Message, Option<Key>> {
        let Some(question) = query.queries.first() else {
            return Ok(error_reply(query, ResponseCode::ServFail));
        };
        let Some(tables) = self.tables.current() else {
            tracing::debug!("DNS query before the name table arrived: SERVFAIL");
            return Ok(error_reply(query, ResponseCode::ServFail));
        };
        let mut hostname = question.name().to_ascii().to_ascii_lowercase();
        if !hostname.ends_with('.') {
            hostname.push('.');
        }
        if let Lookup::Local(records) = tables.lookup.lookup(question.query_type(), &hostname) {
            self.stats.answered_locally.inc();
            let mut reply = reply_to(query);
            // We are the authority for the mesh's names.
            reply.metadata.authoritative = true;
            reply.answers = round_robin(records);
            return Ok(reply);
        }
        let key = Key::of(query);
        if let Some(mut cached) = key.as_ref().and_then(|k| self.cache.get(k)) {
            self.stats.cache_hits.inc();
            cached.metadata.id = query.metadata.id;
            cached.metadata.recursion_desired = query.metadata.recursion_desired;
            // The asker's own spelling of the name (0x20 case randomisation checks it).
            cached.queries = query.queries.clone();
            return Ok(cached);
        }
        Err(key)
    }

    pub fn stats(&self) -> &DnsStats {
        &self.stats
    }
}

/// A reply with the query's id, opcode, RD and CD bits and its question.
fn reply_to(query: &Message) -> Message {
    let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.checking_disabled = query.metadata.checking_disabled;
    reply.queries = query.queries.iter().take(1).cloned().collect();
    reply
}

fn error_reply(query: &Message, code: ResponseCode) -> Message {
    let mut reply = reply_to(query);
    reply.metadata.response_code = code;
    reply
}

/// CNAMEs first, then the addresses in a random order (DNS load balancing over a
/// headless service's pods, as kube-dns and Istio's agent do).
fn round_robin(records: Vec<hickory_proto::rr::Record>) -> Vec<hickory_proto::rr::Record> {
    let (mut out, mut addresses): (Vec<_>, Vec<_>) = records
        .into_iter()
        .partition(|r| r.record_type() == RecordType::CNAME);
    fastrand::shuffle(&mut addresses);
    out.extend(addresses);
    out
}

/// The reply on the wire; over UDP cut to what the client can take (512 bytes, or its
/// EDNS payload size) with the TC bit, so it asks again over TCP.
fn encode(query: &Message, response: Message, transport: Transport) -> Option<Vec<u8>> {
    let limit = match transport {
        Transport::Tcp => usize::from(u16::MAX),
        Transport::Udp => usize::from(query.max_payload()),
    };
    match response.to_vec() {
        Ok(bytes) if bytes.len() <= limit => Some(bytes),
        Ok(_) => response.truncate().to_vec().ok(),
        Err(error) => {
            tracing::warn!(%error, "writing a DNS answer failed");
            error_reply(query, ResponseCode::ServFail).to_vec().ok()
        }
    }
}

#[cfg(test)]
mod tests;
