//! `cargo xtask bench <which>`: benchmarks on a node of pods, with release builds.
//!
//! One file a bench: `capture.rs` (direct vs iptables vs eBPF capture), `sockmap.rs`
//! (the proxy-to-proxy short-circuit), `l4.rs` (shunt and Envoy on one tcp_proxy),
//! `http.rs` (shunt, Envoy, haproxy and nginx as HTTP reverse proxies;
//! `http_mtls.rs` its sidecar pair's bootstraps), `xds.rs`
//! (shunt and Envoy taking a large config over ADS), `soak.rs` (mixed traffic for
//! minutes through config changes and crashing upstreams), `dns.rs` (the DNS proxy's
//! local answers and forwards against dnsmasq, with dnsperf), `agent.rs` (`shunt agent`
//! against Envoy plus an agent: time to ready and RSS), `node.rs` (node mode: Istio's push
//! to P pods, `node_scale.rs` and `node_push.rs`; passthrough pods; app-to-app against sidecars), `mesh.rs` (Istio's method:
//! latency added at a fixed rate and CPU per 1000 requests/s, shunt's sidecars and node
//! mode against Envoy sidecars and ztunnel; `mesh_planes.rs` its data planes); what they share (medians,
//! goals, the testapp runner, CPU and memory readings) is in `measure.rs`.

mod agent;
mod capture;
mod dns;
mod http;
mod http_mtls;
mod l4;
mod measure;
mod mesh;
mod mesh_planes;
mod node;
pub(crate) mod node_mesh;
mod node_push;
mod node_scale;
mod node_upgrade;
mod soak;
mod sockmap;
mod xds;

use anyhow::Result;
use clap::Subcommand;

use crate::pods::Bins;

#[derive(Subcommand)]
pub enum Which {
    /// direct vs iptables vs eBPF capture (with shunt proxy): connections/s, latency, CPU.
    Capture(capture::CaptureArgs),
    /// Pod-to-pod through both proxies: iptables vs eBPF without and with the sockmap.
    Sockmap(sockmap::SockmapArgs),
    /// shunt vs Envoy on one static tcp_proxy bootstrap: throughput, connections/s,
    /// latency, RSS idle and with connections open.
    L4(l4::L4Args),
    /// shunt vs Envoy as xDS clients: a push of 10,000 EDS clusters and 1,000 listeners,
    /// then incremental EDS updates; send-to-ACK times and RSS.
    Xds(xds::XdsArgs),
    /// Mixed HTTP/1.1, h2, TCP and mTLS traffic through shunt for 10 minutes while xDS
    /// updates every second and upstreams crash; fails on any unexpected error or on fd
    /// or memory growth after warm-up.
    Soak(soak::SoakArgs),
    /// The DNS proxy against dnsmasq answering directly (dnsperf): local answers,
    /// cached and uncached forwards; queries/s and p99 as ratios.
    Dns(dns::DnsArgs),
    /// One `shunt agent` against pilot-agent's shape (Envoy plus an agent) from Istio's
    /// bootstrap with a 1,000-cluster push: seconds to 15021 ready, RSS.
    Agent(agent::AgentArgs),
    /// shunt vs Envoy, haproxy and nginx as HTTP reverse proxies (one worker each, six
    /// virtual hosts): req/s, p50/p99, CPU per request, RSS; wrk (h1) and h2load (h2).
    Http(http::HttpArgs),
    /// Node mode (one process, every pod): Istio's push of S services to P pods (memory
    /// per pod and per service, time and CPU to ready) beside a shunt and an Envoy
    /// sidecar; passthrough pods' RSS and enrollment; same-node round trips through it
    /// against two eBPF sidecars and direct.
    Node(node::NodeArgs),
    /// Istio's method: two pods on one node, HTTP/1.1 and TCP echo of 1 KB at 1000/s and
    /// at 80% of each plane's maximum, through direct, Envoy sidecars, shunt sidecars,
    /// node mode (L7 fast path on/off, L4) and ztunnel: latency added over direct
    /// (p50..p99.9), CPU per 1000 requests/s, RSS, maximum rate; ratios and goals.
    Mesh(mesh::MeshArgs),
}

/// `cargo xtask pgo`: see [`http::pgo`].
pub fn pgo() -> Result<std::path::PathBuf> {
    http::pgo(Bins::build(true)?)
}

pub fn run(which: Which) -> Result<()> {
    if let Which::Node(args) = &which {
        let bins = if args.no_build {
            Bins::release()?
        } else {
            Bins::build(!args.debug)?
        };
        return node::run(&bins, args);
    }
    if let Which::Mesh(args) = &which {
        let bins = if args.no_build {
            Bins::release()?
        } else {
            Bins::build(!args.debug)?
        };
        return mesh::run(bins, args);
    }
    if let Which::Http(args) = &which
        && args.debug
    {
        return http::run(Bins::build(false)?, args).map(drop);
    }
    let bins = Bins::build(true)?;
    match which {
        Which::Capture(args) => capture::run(&bins, &args),
        Which::Sockmap(args) => sockmap::run(&bins, &args),
        Which::L4(args) => l4::run(bins, &args),
        Which::Xds(args) => xds::run(bins, &args),
        Which::Soak(args) => soak::run(bins, &args),
        Which::Dns(args) => dns::run(&bins, &args),
        Which::Agent(args) => agent::run(bins, &args),
        Which::Http(args) => http::run(bins, &args).map(drop),
        Which::Node(_) | Which::Mesh(_) => unreachable!("handled above"),
    }
}
