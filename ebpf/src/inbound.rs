//! `sk_lookup`: istio-iptables' PREROUTING/ISTIO_INBOUND without NAT. A TCP connection
//! to one of a pod's addresses on a captured port is handed to the pod's inbound
//! listener; the accepted socket's local address stays the original destination. The
//! rules are `shunt_common::inbound`'s.

use aya_ebpf::{macros::sk_lookup, programs::SkLookupContext};
use aya_log_ebpf::warn;
use shunt_common::{
    AF_INET, Addr, AddrKey, Decision, ListenerKey, PodConfig, PortKey, Verdict,
    events::{DecisionEvent, NO_ID},
    flags,
    inbound::{InboundFacts, verdict, without_listener},
    port_kind,
};

use crate::{
    addr::{is_loopback, read6, v4},
    events, log,
    maps::{LISTENERS, POD_ADDRS, POD_PORTS, count, count_pod, is_pod_addr},
};

const IPPROTO_TCP: u32 = 6;
const SK_DROP: u32 = 0;
const SK_PASS: u32 = 1;

#[sk_lookup]
pub fn steer_inbound(ctx: SkLookupContext) -> u32 {
    steer(&ctx)
}

/// The connection as sk_lookup sees it, for its event.
struct Lookup {
    family: u32,
    local: Addr,
    remote: Addr,
    local_port: u16,
    remote_port: u16,
}

impl Lookup {
    #[inline(always)]
    fn report(&self, pod_id: u32, pod_flags: u32, v: Verdict) {
        if events::on(pod_flags) {
            self.send(pod_id, v);
        }
    }

    #[inline(always)]
    fn send(&self, pod_id: u32, v: Verdict) {
        events::send(
            DecisionEvent {
                src: self.remote,
                dst: self.local,
                src_port: self.remote_port,
                dst_port: self.local_port,
                family: self.family,
                pod_id,
                uid: NO_ID,
                gid: NO_ID,
                protocol: IPPROTO_TCP as u8,
                ..DecisionEvent::default()
            },
            v,
        );
    }
}

#[inline(always)]
fn steer(ctx: &SkLookupContext) -> u32 {
    let l = ctx.lookup;
    // SAFETY: `l` is this program's context, the kernel's bpf_sk_lookup, live for the run.
    let (protocol, family) = unsafe { ((*l).protocol, (*l).family) };
    if protocol != IPPROTO_TCP {
        return SK_PASS;
    }
    let (local, remote) = if family == AF_INET {
        // SAFETY: fields of this program's context.
        unsafe { (v4((*l).local_ip4), v4((*l).remote_ip4)) }
    } else {
        // SAFETY: four-word fields of this program's context.
        unsafe {
            (
                read6(&raw const (*l).local_ip6),
                read6(&raw const (*l).remote_ip6),
            )
        }
    };
    // SAFETY: fields of this program's context (local host order, remote network order).
    let (local_port, remote_port) = unsafe { ((*l).local_port as u16, (*l).remote_port) };
    let lookup = Lookup {
        family,
        local,
        remote,
        local_port,
        remote_port: u16::from_be(remote_port),
    };
    let Some(cfg) = POD_ADDRS.get_ptr(&AddrKey {
        addr: local,
        family,
    }) else {
        count(Decision::InboundSkipNotPod);
        if events::node_wide() {
            lookup.send(0, Verdict::ruleless(Decision::InboundSkipNotPod));
        }
        return SK_PASS;
    };
    // SAFETY: value pointer from a successful lookup.
    let cfg = unsafe { *cfg };
    let verdict = verdict(&facts(&cfg, &remote, family, local_port));
    if verdict.decision != Decision::InboundSteered {
        count_pod(cfg.pod_id, verdict.decision);
        lookup.report(cfg.pod_id, cfg.flags, verdict);
        return SK_PASS;
    }
    let key = ListenerKey {
        pod_id: cfg.pod_id,
        family,
    };
    if LISTENERS.redirect_sk_lookup(ctx, key, 0).is_ok() {
        count_pod(cfg.pod_id, Decision::InboundSteered);
        lookup.report(cfg.pod_id, cfg.flags, verdict);
        return SK_PASS;
    }
    let fallback = without_listener(cfg.flags & flags::FAIL_OPEN != 0);
    count_pod(cfg.pod_id, fallback.decision);
    lookup.report(cfg.pod_id, cfg.flags, fallback);
    if fallback.decision == Decision::FailOpenNoProxy {
        // Node mode's fail-open pod with nothing serving it: straight to the app.
        if log::due(log::kind::FAIL_OPEN) {
            warn!(
                ctx,
                "pod {}: no inbound listener: connection to port {} passed to the app without its proxy (fail-open)",
                cfg.pod_id,
                local_port
            );
        }
        SK_PASS
    } else {
        // As with iptables, nothing reaches the app around its proxy (fail closed).
        if log::due(log::kind::NO_LISTENER) {
            warn!(
                ctx,
                "pod {}: no inbound listener registered: connection to port {} refused (fail-closed)",
                cfg.pod_id,
                local_port
            );
        }
        SK_DROP
    }
}

/// What the ISTIO_INBOUND rules look at, read from the maps; only the port list the
/// pod's `-b` uses is looked up.
#[inline(always)]
fn facts(cfg: &PodConfig, remote: &Addr, family: u32, port: u16) -> InboundFacts {
    let all_ports = cfg.flags & flags::INBOUND_ALL_PORTS != 0;
    InboundFacts {
        // Locally generated connections never see PREROUTING's NAT: the connect hook decided.
        local_source: is_loopback(remote, family) || is_pod_addr(*remote, family, cfg.pod_id),
        capture: cfg.flags & flags::INBOUND != 0,
        all_ports,
        port_excluded: all_ports && has_port(cfg.pod_id, port, port_kind::INBOUND_EXCLUDE),
        port_listed: !all_ports && has_port(cfg.pod_id, port, port_kind::INBOUND_INCLUDE),
    }
}

/// ISTIO_INBOUND's port rules: `-b '*'` minus exclusions, or only the listed ports.
#[inline(always)]
pub fn captures_port(cfg: &PodConfig, port: u16) -> bool {
    if cfg.flags & flags::INBOUND == 0 {
        false
    } else if cfg.flags & flags::INBOUND_ALL_PORTS != 0 {
        !has_port(cfg.pod_id, port, port_kind::INBOUND_EXCLUDE)
    } else {
        has_port(cfg.pod_id, port, port_kind::INBOUND_INCLUDE)
    }
}

#[inline(always)]
fn has_port(pod_id: u32, port: u16, kind: u16) -> bool {
    POD_PORTS.get_ptr(&PortKey { pod_id, port, kind }).is_some()
}
