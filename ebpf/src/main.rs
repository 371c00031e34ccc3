//! shunt's kernel side: one program per hook, each small and branch-light.
//!
//! - `connect.rs`: `cgroup/connect4|6` decide capture (istio-iptables' ISTIO_OUTPUT) and
//!   rewrite the destination to the proxy, remembering the original by socket cookie.
//! - `dns.rs`: `cgroup/sendmsg4|6` send the pod's UDP DNS queries to the DNS proxy and
//!   `cgroup/recvmsg4|6` give its replies the resolver's address back.
//! - `original_dst.rs`: `sockops` moves that record to the connection's 4-tuple, and
//!   `cgroup/getsockopt` answers `SO_ORIGINAL_DST` from it; `sockops` also registers each
//!   pod's inbound listener for `sk_lookup`.
//! - `inbound.rs`: `sk_lookup` steers connections for a pod's addresses to its inbound
//!   listener (ISTIO_INBOUND), without rewriting packets.
//! - `shortcircuit.rs`: `sk_msg` hands sends between local socket pairs straight to the
//!   peer, skipping the TCP/IP stack.
//! - `events.rs`: each of them can report its decisions to user space (off by default);
//!   `log.rs`: aya-log for the rare things an operator must hear about.
#![no_std]
#![no_main]
// Every unsafe block says why it is sound (checked by `cargo clippy` in this directory).
#![deny(clippy::undocumented_unsafe_blocks)]

mod addr;
mod connect;
mod dns;
mod events;
mod inbound;
mod log;
mod maps;
mod original_dst;
mod shortcircuit;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
