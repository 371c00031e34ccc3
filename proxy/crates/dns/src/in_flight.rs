//! The bound on queries forwarded upstream at once: in total and per client (source
//! address). A resolver that stops answering holds each forwarded query until its
//! timeout; without a bound a busy client could pile up tasks and buffers without end.
//! Over the bound a query is shed: answered SERVFAIL at once (the client's stub retries
//! or fails over) and counted in `dns.upstream_shed_total`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// Queries in flight upstream at once, from all clients of one DNS proxy.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Queries in flight upstream at once from one client address.
pub const MAX_IN_FLIGHT_PER_CLIENT: usize = 256;

/// What is in flight now.
#[derive(Debug)]
pub struct InFlight {
    total_limit: usize,
    client_limit: usize,
    /// Per client; the sum is the total.
    clients: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted query: its place is given back when this drops.
#[derive(Debug)]
pub struct Permit {
    in_flight: Arc<InFlight>,
    client: IpAddr,
}

impl InFlight {
    pub fn new(total_limit: usize, client_limit: usize) -> Arc<InFlight> {
        Arc::new(InFlight {
            total_limit,
            client_limit,
            clients: Mutex::new(HashMap::new()),
        })
    }

    /// A place for one more query from `client`, or `None` when it or everyone is at
    /// the bound.
    pub fn admit(self: &Arc<Self>, client: IpAddr) -> Option<Permit> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let total: usize = clients.values().sum();
        let mine = clients.get(&client).copied().unwrap_or(0);
        if total >= self.total_limit || mine >= self.client_limit {
            return None;
        }
        *clients.entry(client).or_default() += 1;
        Some(Permit {
            in_flight: self.clone(),
            client,
        })
    }

    /// Queries in flight now.
    pub fn total(&self) -> usize {
        let clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        clients.values().sum()
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut clients = self
            .in_flight
            .clients
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(count) = clients.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                clients.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_and_the_total_are_bounded_and_places_come_back() {
        let in_flight = InFlight::new(3, 2);
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let a1 = in_flight.admit(a).unwrap();
        let _a2 = in_flight.admit(a).unwrap();
        assert!(in_flight.admit(a).is_none(), "a is at its bound");
        let _b1 = in_flight.admit(b).unwrap();
        assert!(in_flight.admit(b).is_none(), "everyone is at the bound");
        drop(a1);
        assert_eq!(in_flight.total(), 2);
        assert!(in_flight.admit(b).is_some());
    }
}
