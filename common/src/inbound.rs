//! istio-iptables' PREROUTING/ISTIO_INBOUND as one pure function, shared by `sk_lookup`
//! and `shunt inspect --explain`: which inbound TCP connections to a pod's address go
//! to its inbound listener (rule 13), which pass to the app (rules 9-12, `-b PORTS`),
//! and what happens when the listener is not there.

use crate::{Decision, Rule, Verdict};

/// What `sk_lookup` knows about one inbound TCP connection to one of a pod's addresses.
#[derive(Clone, Copy, Debug, Default)]
pub struct InboundFacts {
    /// The source is loopback or the pod's own address: locally generated, it never
    /// meets PREROUTING (the connect hook decided it).
    pub local_source: bool,
    /// Inbound capture is on (`-b` not empty).
    pub capture: bool,
    /// `-b '*'`: every port but the excluded ones.
    pub all_ports: bool,
    /// With `all_ports`: the port is the tunnel port or in `-d` (read only then).
    pub port_excluded: bool,
    /// Without `all_ports`: the port is in `-b PORTS` (read only then).
    pub port_listed: bool,
}

/// Steer to the inbound listener (`InboundSteered`) or pass to the app.
#[inline(always)]
pub fn verdict(f: &InboundFacts) -> Verdict {
    if f.local_source {
        return Verdict::ruleless(Decision::InboundSkipLocalSource);
    }
    if !f.capture {
        return Verdict::new(Decision::InboundSkipPort, Rule::NoInboundCapture);
    }
    if f.all_ports {
        // 9-12 (today: the tunnel port first): -p tcp --dport P -j RETURN
        if f.port_excluded {
            return Verdict::new(Decision::InboundSkipPort, Rule::InboundExcludedPort);
        }
    } else if !f.port_listed {
        return Verdict::new(Decision::InboundSkipPort, Rule::NotListedInboundPort);
    }
    // 13: -p tcp -j ISTIO_IN_REDIRECT
    Verdict::new(Decision::InboundSteered, Rule::InboundRedirect)
}

/// Whether the port is captured (the port half of [`verdict`]).
#[inline(always)]
pub fn captures_port(f: &InboundFacts) -> bool {
    f.capture
        && if f.all_ports {
            !f.port_excluded
        } else {
            f.port_listed
        }
}

/// A connection [`verdict`] steers, when the pod has no inbound listener: a
/// `fail-open` pod's goes to the app; otherwise it is dropped, as REDIRECT to a closed
/// port resets it, so nothing reaches the app around its proxy.
#[inline(always)]
pub fn without_listener(fail_open: bool) -> Verdict {
    if fail_open {
        Verdict::ruleless(Decision::FailOpenNoProxy)
    } else {
        Verdict::new(Decision::InboundNoListener, Rule::InboundRedirect)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed() -> InboundFacts {
        InboundFacts {
            capture: true,
            all_ports: true,
            ..Default::default()
        }
    }

    #[test]
    fn the_seeds_flags_steer_every_port_but_the_excluded() {
        assert_eq!(
            verdict(&seed()),
            Verdict::new(Decision::InboundSteered, Rule::InboundRedirect)
        );
        let excluded = InboundFacts {
            port_excluded: true,
            ..seed()
        };
        assert_eq!(
            verdict(&excluded),
            Verdict::new(Decision::InboundSkipPort, Rule::InboundExcludedPort)
        );
        assert!(!captures_port(&excluded) && captures_port(&seed()));
    }

    #[test]
    fn listed_ports_only_and_no_inbound_capture() {
        let listed = InboundFacts {
            all_ports: false,
            port_listed: true,
            ..seed()
        };
        assert_eq!(verdict(&listed).decision, Decision::InboundSteered);
        let unlisted = InboundFacts {
            port_listed: false,
            ..listed
        };
        assert_eq!(verdict(&unlisted).rule, Rule::NotListedInboundPort);
        let off = InboundFacts {
            capture: false,
            ..seed()
        };
        assert_eq!(verdict(&off).rule, Rule::NoInboundCapture);
    }

    #[test]
    fn local_sources_are_left_to_the_connect_hook() {
        let local = InboundFacts {
            local_source: true,
            ..seed()
        };
        assert_eq!(verdict(&local).decision, Decision::InboundSkipLocalSource);
    }

    #[test]
    fn without_a_listener_fail_closed_drops_and_fail_open_passes() {
        assert_eq!(
            without_listener(false).decision,
            Decision::InboundNoListener
        );
        assert_eq!(without_listener(true).decision, Decision::FailOpenNoProxy);
    }
}
