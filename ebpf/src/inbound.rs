//! `sk_lookup`: istio-iptables' PREROUTING/ISTIO_INBOUND without NAT. A TCP connection
//! to one of a pod's addresses on a captured port is handed to the pod's inbound
//! listener; the accepted socket's local address stays the original destination.

use aya_ebpf::{macros::sk_lookup, programs::SkLookupContext};
use shunt_common::{AF_INET, AddrKey, Decision, ListenerKey, PodConfig, PortKey, flags, port_kind};

use crate::{
    addr::{is_loopback, read6, v4},
    maps::{LISTENERS, POD_ADDRS, POD_PORTS, count, count_pod, is_pod_addr},
};

const IPPROTO_TCP: u32 = 6;
const SK_DROP: u32 = 0;
const SK_PASS: u32 = 1;

#[sk_lookup]
pub fn steer_inbound(ctx: SkLookupContext) -> u32 {
    steer(&ctx)
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
    let Some(cfg) = POD_ADDRS.get_ptr(&AddrKey {
        addr: local,
        family,
    }) else {
        count(Decision::InboundSkipNotPod);
        return SK_PASS;
    };
    // SAFETY: value pointer from a successful lookup.
    let cfg = unsafe { *cfg };
    // Locally generated connections never see PREROUTING's NAT: the connect hook decided.
    if is_loopback(&remote, family) || is_pod_addr(remote, family, cfg.pod_id) {
        count_pod(cfg.pod_id, Decision::InboundSkipLocalSource);
        return SK_PASS;
    }
    // SAFETY: a field of this program's context.
    let port = unsafe { (*l).local_port } as u16;
    if !captures_port(&cfg, port) {
        count_pod(cfg.pod_id, Decision::InboundSkipPort);
        return SK_PASS;
    }
    let key = ListenerKey {
        pod_id: cfg.pod_id,
        family,
    };
    match LISTENERS.redirect_sk_lookup(ctx, key, 0) {
        Ok(()) => {
            count_pod(cfg.pod_id, Decision::InboundSteered);
            SK_PASS
        }
        Err(_) if cfg.flags & flags::FAIL_OPEN != 0 => {
            // Node mode's fail-open pod with nothing serving it: straight to the app.
            count_pod(cfg.pod_id, Decision::FailOpenNoProxy);
            SK_PASS
        }
        Err(_) => {
            // As with iptables, nothing reaches the app around its proxy (fail closed).
            count_pod(cfg.pod_id, Decision::InboundNoListener);
            SK_DROP
        }
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
