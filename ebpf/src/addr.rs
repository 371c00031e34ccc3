//! Address helpers. Addresses stay in network byte order as the kernel gives them;
//! `from_ne_bytes` builds constants in that same order.

use core::ptr::read_volatile;

use shunt_common::{AF_INET, Addr};

pub const LOCALHOST4: u32 = u32::from_ne_bytes([127, 0, 0, 1]);
pub const PASSTHROUGH4: u32 = u32::from_ne_bytes(shunt_common::INBOUND_PASSTHROUGH_V4);
const V4_MAPPED_PREFIX: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);
const ONE: u32 = u32::from_ne_bytes([0, 0, 0, 1]);
const SIX: u32 = u32::from_ne_bytes([0, 0, 0, 6]);

pub const fn v4(addr: u32) -> Addr {
    [addr, 0, 0, 0]
}

/// Reads an IPv6 address from a context field one 32-bit word at a time: several
/// contexts only allow 4-byte loads there, and LLVM may otherwise merge them.
///
/// # Safety
/// `words` must point at four readable 32-bit words (an IPv6 field of the context).
#[inline(always)]
pub unsafe fn read6(words: *const [u32; 4]) -> Addr {
    let p = words as *const u32;
    // SAFETY: the caller guarantees four readable words at `p`; `add` stays inside them.
    unsafe {
        [
            read_volatile(p),
            read_volatile(p.add(1)),
            read_volatile(p.add(2)),
            read_volatile(p.add(3)),
        ]
    }
}

/// `::ffff:a.b.c.d` → `a.b.c.d`: a dual-stack socket talking IPv4.
#[inline(always)]
pub fn unmap_v4(addr: &Addr) -> Option<u32> {
    (addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_PREFIX).then_some(addr[3])
}

pub fn map_v4(addr: u32) -> Addr {
    [0, 0, V4_MAPPED_PREFIX, addr]
}

#[inline(always)]
pub fn is_loopback4(addr: u32) -> bool {
    addr.to_ne_bytes()[0] == 127
}

pub const LOCALHOST6: Addr = [0, 0, 0, ONE];
pub const PASSTHROUGH6: Addr = [0, 0, 0, SIX];

#[inline(always)]
pub fn is_unspecified6(a: &Addr) -> bool {
    a[0] == 0 && a[1] == 0 && a[2] == 0 && a[3] == 0
}

#[inline(always)]
pub fn eq6(a: &Addr, b: &Addr) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}

/// Loopback or unspecified: routed over `lo` whatever the pod's addresses are.
#[inline(always)]
pub fn is_loopback(addr: &Addr, family: u32) -> bool {
    if family == AF_INET {
        is_loopback4(addr[0]) || addr[0] == 0
    } else {
        eq6(addr, &LOCALHOST6) || is_unspecified6(addr)
    }
}
