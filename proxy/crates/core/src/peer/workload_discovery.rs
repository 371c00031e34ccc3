//! Istio's workload discovery (WDS): the `istio.workload.Workload` resources istiod
//! serves over xDS (ztunnel's workload API), indexed by IP address, so that the HTTP
//! peer metadata filter finds a peer by its address when it sent no metadata
//! (istio-proxy's `istio.workload.BootstrapExtension` and its `workload_discovery`
//! method).
//!
//! One index per proxy instance, as istio-proxy keeps one (a singleton) for all its
//! listeners: in node mode each pod's xDS stream is its own state of the world, so
//! pods cannot share one. The instance's [`super::LocalNode`] carries it (every
//! snapshot of the instance hands it on to the next); its xDS manager replaces it whole
//! on each accepted update ([`WorkloadDiscovery::apply`]), filters read it without locks. A workload maps to
//! istio-proxy's `WorkloadMetadataObject` as its `convert` does: app and version are
//! the canonical name and revision, and the identity is the SPIFFE id
//! `spiffe://<trust domain>/ns/<namespace>/sa/<service account>` with Istio's
//! defaults for the parts istiod leaves out.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use arc_swap::ArcSwap;

use super::{Workload, WorkloadType};

/// `type.googleapis.com/istio.workload.Workload`.
pub const TYPE_URL: &str = "type.googleapis.com/istio.workload.Workload";

/// The bootstrap extension that turns workload discovery on.
pub const EXTENSION: &str = "istio.workload.BootstrapExtension";

/// What istiod leaves out when it is the mesh default.
const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";
const DEFAULT_NAMESPACE: &str = "default";
const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// `istio.workload.Workload`: the fields istio-proxy reads (`istio/workload.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct WorkloadResource {
    #[prost(string, tag = "20")]
    pub uid: String,
    /// The pod name.
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    /// 4 bytes (IPv4) or 16 (IPv6), network order.
    #[prost(bytes = "vec", repeated, tag = "3")]
    pub addresses: Vec<Vec<u8>>,
    #[prost(string, tag = "4")]
    pub network: String,
    #[prost(string, tag = "6")]
    pub trust_domain: String,
    #[prost(string, tag = "7")]
    pub service_account: String,
    #[prost(string, tag = "10")]
    pub canonical_name: String,
    #[prost(string, tag = "11")]
    pub canonical_revision: String,
    /// `istio.workload.WorkloadType`: DEPLOYMENT 0, CRONJOB 1, POD 2, JOB 3.
    #[prost(int32, tag = "12")]
    pub workload_type: i32,
    #[prost(string, tag = "13")]
    pub workload_name: String,
    #[prost(string, tag = "18")]
    pub cluster_id: String,
}

impl prost::Name for WorkloadResource {
    const NAME: &'static str = "Workload";
    const PACKAGE: &'static str = "istio.workload";

    fn type_url() -> String {
        TYPE_URL.to_owned()
    }
}

/// `istio.workload.BootstrapExtension`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BootstrapExtension {
    #[prost(message, optional, tag = "1")]
    pub config_source: Option<envoy_types::pb::envoy::config::core::v3::ConfigSource>,
}

/// A workload resource that cannot be indexed, naming it and the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkloadError {
    #[error(
        "Workload {name:?}: addresses[{index}] is {len} bytes; an address is 4 bytes (IPv4) or 16 (IPv6)"
    )]
    BadAddress {
        name: String,
        index: usize,
        len: usize,
    },
}

impl WorkloadResource {
    /// The workload's addresses; an error names the resource (`name`, its xDS name) and
    /// the address that is neither IPv4 nor IPv6.
    pub fn ips(&self, name: &str) -> Result<Vec<IpAddr>, WorkloadError> {
        self.addresses
            .iter()
            .enumerate()
            .map(|(index, bytes)| match bytes.len() {
                4 => Ok(IpAddr::V4(Ipv4Addr::from(
                    <[u8; 4]>::try_from(bytes.as_slice()).expect("4 bytes"),
                ))),
                16 => Ok(IpAddr::V6(Ipv6Addr::from(
                    <[u8; 16]>::try_from(bytes.as_slice()).expect("16 bytes"),
                ))),
                len => Err(WorkloadError::BadAddress {
                    name: name.to_owned(),
                    index,
                    len,
                }),
            })
            .collect()
    }

    /// The workload as Istio's telemetry sees it (istio-proxy's `convert`).
    pub fn workload(&self) -> Workload {
        let or = |value: &str, default: &str| {
            if value.is_empty() {
                default.to_owned()
            } else {
                value.to_owned()
            }
        };
        let namespace = or(&self.namespace, DEFAULT_NAMESPACE);
        let identity = format!(
            "spiffe://{}/ns/{namespace}/sa/{}",
            or(&self.trust_domain, DEFAULT_TRUST_DOMAIN),
            or(&self.service_account, DEFAULT_SERVICE_ACCOUNT),
        );
        Workload {
            instance_name: self.name.clone(),
            cluster_name: self.cluster_id.clone(),
            namespace_name: namespace,
            workload_name: self.workload_name.clone(),
            canonical_name: self.canonical_name.clone(),
            canonical_revision: self.canonical_revision.clone(),
            app_name: self.canonical_name.clone(),
            app_version: self.canonical_revision.clone(),
            workload_type: match self.workload_type {
                1 => WorkloadType::CronJob,
                2 => WorkloadType::Pod,
                3 => WorkloadType::Job,
                _ => WorkloadType::Deployment,
            },
            identity,
        }
    }
}

/// The accepted workloads: each by its xDS name, and each address to its workload.
#[derive(Debug, Default)]
pub struct Index {
    by_name: BTreeMap<String, (Vec<IpAddr>, Arc<Workload>)>,
    by_address: HashMap<IpAddr, Arc<Workload>>,
}

impl Index {
    pub fn get(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_address.get(&ip.to_canonical())
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    /// The xDS names of the workloads held.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    fn insert(&mut self, name: String, ips: Vec<IpAddr>, workload: Arc<Workload>) {
        self.remove(&name);
        for ip in &ips {
            self.by_address.insert(*ip, workload.clone());
        }
        self.by_name.insert(name, (ips, workload));
    }

    fn remove(&mut self, name: &str) {
        let Some((ips, old)) = self.by_name.remove(name) else {
            return;
        };
        for ip in ips {
            // Another workload may have taken the address since.
            if self
                .by_address
                .get(&ip)
                .is_some_and(|held| Arc::ptr_eq(held, &old))
            {
                self.by_address.remove(&ip);
            }
        }
    }
}

/// How an xDS response changes the set of workloads.
pub enum Change<'a> {
    /// State of the world: this is the whole set.
    Replace(Vec<(&'a str, &'a WorkloadResource)>),
    /// Delta: these added or replaced, these names removed.
    Patch {
        upserts: Vec<(&'a str, &'a WorkloadResource)>,
        removals: Vec<&'a str>,
    },
}

/// A proxy instance's workload index, swapped whole on each update.
#[derive(Debug, Default)]
pub struct WorkloadDiscovery {
    current: ArcSwap<Index>,
}

/// Two indexes are equal when they are the same one (an instance's node compares equal
/// to itself across snapshots, never to another instance's).
impl PartialEq for WorkloadDiscovery {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for WorkloadDiscovery {}

impl WorkloadDiscovery {
    /// The workload at `ip`, if one is known.
    pub fn get(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.current.load().get(ip).cloned()
    }

    pub fn load(&self) -> Arc<Index> {
        self.current.load_full()
    }

    /// Applies one update resource by resource, as xDS is judged: the valid workloads
    /// go in, each invalid one is left as it was (its last good version, or absent) and
    /// returned with why, for the NACK. Readers see the update at once, whole.
    pub fn apply(&self, change: Change<'_>) -> Vec<(String, WorkloadError)> {
        let current = self.current.load();
        let mut refused = Vec::new();
        let (mut next, upserts) = match change {
            Change::Replace(all) => {
                // What is not in the new set goes; a refused one keeps its last version.
                let mut next = Index::default();
                for (name, _) in &all {
                    if let Some((ips, workload)) = current.by_name.get(*name) {
                        next.insert((*name).to_owned(), ips.clone(), workload.clone());
                    }
                }
                (next, all)
            }
            Change::Patch { upserts, removals } => {
                let mut next = Index::default();
                for (name, (ips, workload)) in &current.by_name {
                    next.insert(name.clone(), ips.clone(), workload.clone());
                }
                for name in removals {
                    next.remove(name);
                }
                (next, upserts)
            }
        };
        for (name, resource) in upserts {
            match resource.ips(name) {
                Ok(ips) => next.insert(name.to_owned(), ips, Arc::new(resource.workload())),
                Err(err) => refused.push((name.to_owned(), err)),
            }
        }
        self.current.store(Arc::new(next));
        refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    fn pod(uid: &str, addresses: &[&[u8]]) -> WorkloadResource {
        WorkloadResource {
            uid: uid.into(),
            name: "ratings-v1-abc".into(),
            namespace: "bookinfo".into(),
            addresses: addresses.iter().map(|a| a.to_vec()).collect(),
            service_account: "ratings".into(),
            canonical_name: "ratings".into(),
            canonical_revision: "v1".into(),
            workload_name: "ratings-v1".into(),
            cluster_id: "Kubernetes".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_workload_decodes_from_ztunnels_field_numbers() {
        // uid (20), name (1), namespace (2), addresses (3), trust_domain (6),
        // service_account (7), canonical_name (10), workload_type (12) by hand.
        let mut wire = Vec::new();
        wire.extend([0xa2, 0x01, 3]);
        wire.extend(b"u-1");
        wire.extend([0x0a, 1, b'p', 0x12, 2, b'n', b's']);
        wire.extend([0x1a, 4, 10, 0, 0, 7]);
        wire.extend([0x32, 2, b't', b'd', 0x3a, 2, b's', b'a']);
        wire.extend([0x52, 3, b'a', b'p', b'p', 0x60, 3]);
        let decoded = WorkloadResource::decode(wire.as_slice()).unwrap();
        assert_eq!(decoded.uid, "u-1");
        assert_eq!(
            decoded.ips("u-1").unwrap(),
            ["10.0.0.7".parse::<IpAddr>().unwrap()]
        );
        let workload = decoded.workload();
        assert_eq!(workload.instance_name, "p");
        assert_eq!(workload.namespace_name, "ns");
        assert_eq!(workload.app_name, "app");
        assert_eq!(workload.canonical_name, "app");
        assert_eq!(workload.workload_type, WorkloadType::Job);
        assert_eq!(workload.identity, "spiffe://td/ns/ns/sa/sa");
    }

    #[test]
    fn identity_takes_istios_defaults_for_what_istiod_leaves_out() {
        let workload = WorkloadResource::default().workload();
        assert_eq!(
            workload.identity,
            "spiffe://cluster.local/ns/default/sa/default"
        );
        assert_eq!(workload.workload_type, WorkloadType::Deployment);
    }

    #[test]
    fn the_index_finds_a_workload_by_each_of_its_addresses_v4_and_v6() {
        let wds = WorkloadDiscovery::default();
        let v6 = "fd00::7".parse::<Ipv6Addr>().unwrap().octets();
        let w = pod("u-1", &[&[10, 0, 0, 7], &v6]);
        assert!(wds.apply(Change::Replace(vec![("u-1", &w)])).is_empty());
        for ip in ["10.0.0.7", "fd00::7", "::ffff:10.0.0.7"] {
            let found = wds.get(ip.parse().unwrap()).expect(ip);
            assert_eq!(found.workload_name, "ratings-v1");
            assert_eq!(found.app_version, "v1");
        }
        assert!(wds.get("10.0.0.8".parse().unwrap()).is_none());
    }

    #[test]
    fn a_bad_address_length_is_refused_by_name_and_the_rest_applies() {
        let wds = WorkloadDiscovery::default();
        let good = pod("good", &[&[10, 0, 0, 1]]);
        let bad = pod("bad", &[&[10, 0, 0, 2], &[1, 2, 3]]);
        let refused = wds.apply(Change::Replace(vec![("good", &good), ("bad", &bad)]));
        assert_eq!(refused.len(), 1);
        assert_eq!(
            refused[0].1.to_string(),
            "Workload \"bad\": addresses[1] is 3 bytes; an address is 4 bytes (IPv4) or 16 (IPv6)"
        );
        assert!(wds.get("10.0.0.1".parse().unwrap()).is_some());
        assert!(wds.get("10.0.0.2".parse().unwrap()).is_none());
    }

    #[test]
    fn delta_removal_by_name_drops_every_address_and_sotw_omission_does_too() {
        let wds = WorkloadDiscovery::default();
        let a = pod("a", &[&[10, 0, 0, 1], &[10, 0, 0, 11]]);
        let b = pod("b", &[&[10, 0, 0, 2]]);
        wds.apply(Change::Patch {
            upserts: vec![("a", &a), ("b", &b)],
            removals: vec![],
        });
        wds.apply(Change::Patch {
            upserts: vec![],
            removals: vec!["a"],
        });
        assert!(wds.get("10.0.0.1".parse().unwrap()).is_none());
        assert!(wds.get("10.0.0.11".parse().unwrap()).is_none());
        assert!(wds.get("10.0.0.2".parse().unwrap()).is_some());
        wds.apply(Change::Replace(vec![("a", &a)]));
        assert!(wds.get("10.0.0.2".parse().unwrap()).is_none());
        assert_eq!(wds.load().len(), 1);
    }

    #[test]
    fn a_workload_moving_to_a_new_address_leaves_the_old_one() {
        let wds = WorkloadDiscovery::default();
        wds.apply(Change::Replace(vec![("a", &pod("a", &[&[10, 0, 0, 1]]))]));
        wds.apply(Change::Replace(vec![("a", &pod("a", &[&[10, 0, 0, 9]]))]));
        assert!(wds.get("10.0.0.1".parse().unwrap()).is_none());
        assert!(wds.get("10.0.0.9".parse().unwrap()).is_some());
    }
}
