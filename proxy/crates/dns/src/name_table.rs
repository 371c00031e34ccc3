//! Istio's name table (`istio.networking.nds.v1.NameTable`), as istiod sends it over xDS
//! when the agent asks for DNS (`ISTIO_META_DNS_CAPTURE`), and the lookup table the
//! agent's DNS server builds from it (istio/istio `pkg/dns/client/dns.go`).
//!
//! The lookup table holds every name the pod may ask for a mesh host: a Kubernetes
//! service as `name.ns.svc.cluster.local.`, `name.ns.`, `name.ns.svc.` and, in the
//! proxy's own namespace, `name.`; any other host (ServiceEntry hosts, wildcards) as
//! itself. Each of those names is also stored under the first search domain of
//! `resolv.conf` appended (`name.ns1.svc.cluster.local.` for the host `name.`) as a
//! CNAME back to the name, because that is the first query a resolver sends for it.
//! A name that is in the table is answered here, even when it has no address of the
//! asked family (NOERROR with no answer: NXDOMAIN would make a client asking A and
//! AAAA at once give up); a name that is not is forwarded.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record, RecordType};

/// `type.googleapis.com/istio.networking.nds.v1.NameTable`.
pub const TYPE_URL: &str = "type.googleapis.com/istio.networking.nds.v1.NameTable";

/// The TTL of local answers: Istio's, low so a client that honours it soon sees a new
/// address.
pub const LOCAL_TTL: u32 = 30;

/// The registry name of Kubernetes services, the only ones whose short forms exist.
const KUBERNETES: &str = "Kubernetes";

/// istio.networking.nds.v1.NameTable (`nds.proto`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct NameTable {
    /// Hostname to what it resolves to.
    #[prost(map = "string, message", tag = "1")]
    pub table: HashMap<String, NameInfo>,
}

/// istio.networking.nds.v1.NameTable.NameInfo.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NameInfo {
    #[prost(string, repeated, tag = "1")]
    pub ips: Vec<String>,
    /// `Kubernetes` for services, else e.g. `External` (ServiceEntry).
    #[prost(string, tag = "2")]
    pub registry: String,
    /// The Kubernetes service's name.
    #[prost(string, tag = "3")]
    pub shortname: String,
    /// The Kubernetes service's namespace.
    #[prost(string, tag = "4")]
    pub namespace: String,
    /// Deprecated in Istio, still honoured by its agent.
    #[prost(string, repeated, tag = "5")]
    pub alt_hosts: Vec<String>,
}

impl prost::Name for NameTable {
    const NAME: &'static str = "NameTable";
    const PACKAGE: &'static str = "istio.networking.nds.v1";

    fn type_url() -> String {
        TYPE_URL.to_owned()
    }
}

/// A name table that cannot be used, naming the entry and value at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    #[error("NameTable.table[{host:?}].ips[{index}]: {ip:?} is not an IP address")]
    BadIp {
        host: String,
        index: usize,
        ip: String,
    },
    #[error("NameTable.table[{host:?}]: not a DNS name: {reason}")]
    BadHost { host: String, reason: String },
}

/// Where the proxy sits, which decides the short names of Kubernetes services.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// The pod's namespace: `name.` resolves only for services in it.
    pub namespace: String,
    /// The proxy's DNS domain without the namespace (`svc.cluster.local`), split.
    domain_parts: Vec<String>,
    /// The `search` domains of the pod's `resolv.conf`, in order.
    pub search: Vec<String>,
}

impl Scope {
    /// `domain` is Istio's proxy domain (`ns.svc.cluster.local`, the fourth field of the
    /// node id); a leading namespace label is dropped, as Istio's agent does.
    pub fn new(namespace: &str, domain: &str, search: Vec<String>) -> Scope {
        let mut parts: Vec<String> = domain
            .split('.')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        if parts.first().is_some_and(|p| p == namespace) {
            parts.remove(0);
        }
        Scope {
            namespace: namespace.to_owned(),
            domain_parts: parts,
            search,
        }
    }

    /// `svc.cluster.local`.
    pub fn domain(&self) -> String {
        self.domain_parts.join(".")
    }
}

/// The names one table entry answers for (Istio's `generateAltHosts`), each ending in a
/// dot. A Kubernetes service gets its short forms only in the proxy's own domain (its
/// `name.ns` would be ambiguous across clusters of other domains).
pub fn alt_hosts(host: &str, info: &NameInfo, scope: &Scope) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    if info.registry != KUBERNETES {
        out.insert(if host.ends_with('.') {
            host.to_owned()
        } else {
            format!("{host}.")
        });
        return out;
    }
    // Istio skips a Kubernetes host written as a FQDN.
    if host.ends_with('.') {
        return out;
    }
    out.insert(format!("{host}."));
    let domain = scope.domain();
    if domain.is_empty() || !host.ends_with(&domain) {
        return out;
    }
    let (name, ns) = (&info.shortname, &info.namespace);
    out.insert(format!("{name}.{ns}."));
    if scope.namespace == *ns {
        out.insert(format!("{name}."));
    }
    // Only the first domain label (`svc`): longer forms are the FQDN already.
    out.insert(format!("{name}.{ns}.{}.", scope.domain_parts[0]));
    for alt in &info.alt_hosts {
        out.insert(format!("{alt}."));
    }
    out
}

/// The answers of one lookup: records, or the name is not ours.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The name is in the table: answer these (maybe none: NODATA) with NOERROR.
    Local(Vec<Record>),
    /// Not in the table (or not an A/AAAA question about it): forward.
    Forward,
}

/// The lookup table built from one name table.
#[derive(Debug, Default)]
pub struct LookupTable {
    /// Every name answered locally, lower case, ending in a dot.
    all_hosts: HashSet<String>,
    name4: HashMap<String, Vec<Ipv4Addr>>,
    name6: HashMap<String, Vec<Ipv6Addr>>,
    /// A name under the first search domain, to the name it stands for.
    cname: HashMap<String, String>,
}

impl LookupTable {
    /// Builds the table, refusing one with an address or a hostname that is not one.
    pub fn build(table: &NameTable, scope: &Scope) -> Result<LookupTable, TableError> {
        let mut lookup = LookupTable::default();
        // Sorted, so that two entries claiming the same search-domain name resolve the
        // same way every time (Istio's map order is random).
        let sorted: BTreeMap<&String, &NameInfo> = table.table.iter().collect();
        for (host, info) in sorted {
            check_host(host)?;
            let mut v4 = Vec::new();
            let mut v6 = Vec::new();
            for (index, ip) in info.ips.iter().enumerate() {
                match ip.parse::<IpAddr>() {
                    Ok(IpAddr::V4(ip)) => v4.push(ip),
                    // An IPv4-mapped address stays IPv6, as Go's netip has it.
                    Ok(IpAddr::V6(ip)) => v6.push(ip),
                    Err(_) => {
                        return Err(TableError::BadIp {
                            host: host.clone(),
                            index,
                            ip: ip.clone(),
                        });
                    }
                }
            }
            if v4.is_empty() && v6.is_empty() {
                continue;
            }
            let alts = alt_hosts(host, info, scope);
            lookup.insert(&alts, &v4, &v6, scope.search.first().map(String::as_str));
        }
        Ok(lookup)
    }

    /// Istio's `buildDNSAnswers`: each name, plus its CNAME under the first search
    /// domain when that is not a name of its own.
    fn insert(
        &mut self,
        alts: &BTreeSet<String>,
        v4: &[Ipv4Addr],
        v6: &[Ipv6Addr],
        first_search: Option<&str>,
    ) {
        for host in alts {
            let host = host.to_ascii_lowercase();
            self.all_hosts.insert(host.clone());
            if !v4.is_empty() {
                self.name4.insert(host.clone(), v4.to_vec());
            }
            if !v6.is_empty() {
                self.name6.insert(host.clone(), v6.to_vec());
            }
            let Some(search) = first_search else {
                continue;
            };
            let search = search.trim_end_matches('.');
            if host.ends_with(&format!("{search}.")) {
                continue;
            }
            let expanded = format!("{host}{search}.").to_ascii_lowercase();
            if !alts.contains(&expanded) {
                self.cname.insert(expanded.clone(), host.clone());
                self.all_hosts.insert(expanded);
            }
        }
    }

    /// How many names are answered locally.
    pub fn len(&self) -> usize {
        self.all_hosts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.all_hosts.is_empty()
    }

    /// Istio's `lookupHost`: `question` in lower case, ending in a dot.
    pub fn lookup(&self, qtype: RecordType, question: &str) -> Lookup {
        let mut hostname = question.to_owned();
        let mut wildcard = false;
        if !self.all_hosts.contains(&hostname) {
            // `a.b.example.com.` is covered by `*.b.example.com.`, then `*.example.com.`...
            let labels: Vec<&str> = question.trim_end_matches('.').split('.').collect();
            let found = (0..labels.len()).find_map(|idx| {
                let candidate = format!("*.{}.", labels[idx + 1..].join("."));
                self.all_hosts.contains(&candidate).then_some(candidate)
            });
            match found {
                Some(candidate) => {
                    wildcard = true;
                    hostname = candidate;
                }
                None => return Lookup::Forward,
            }
        }
        let mut answers = Vec::new();
        let mut chained = false;
        if let Some(target) = self.cname.get(&hostname) {
            answers.push(record(question, RData::CNAME(CNAME(name(target)))));
            hostname = target.clone();
            chained = true;
        }
        // A wildcard answers with the asked name, unless a CNAME already named the target.
        let owner = if wildcard && !chained {
            question
        } else {
            hostname.as_str()
        };
        let addresses: Vec<Record> = match qtype {
            RecordType::A => self.name4.get(&hostname).map_or_else(Vec::new, |ips| {
                ips.iter()
                    .map(|ip| record(owner, RData::A(A(*ip))))
                    .collect()
            }),
            RecordType::AAAA => self.name6.get(&hostname).map_or_else(Vec::new, |ips| {
                ips.iter()
                    .map(|ip| record(owner, RData::AAAA(AAAA(*ip))))
                    .collect()
            }),
            // PTR and the rest go to the upstream resolvers.
            _ => return Lookup::Forward,
        };
        if addresses.is_empty() {
            // NODATA: the CNAME alone would send the client after a name with no answer.
            return Lookup::Local(Vec::new());
        }
        answers.extend(addresses);
        Lookup::Local(answers)
    }
}

/// A hostname the table may carry: a DNS name (wildcards allowed), not empty.
fn check_host(host: &str) -> Result<(), TableError> {
    let bad = |reason: String| TableError::BadHost {
        host: host.to_owned(),
        reason,
    };
    if host.trim_end_matches('.').is_empty() {
        return Err(bad("empty".into()));
    }
    Name::from_ascii(host).map_err(|e| bad(e.to_string()))?;
    Ok(())
}

/// `text` ends in a dot and was checked when the table was built.
fn name(text: &str) -> Name {
    Name::from_ascii(text).unwrap_or_else(|_| Name::root())
}

fn record(owner: &str, data: RData) -> Record {
    Record::from_rdata(name(owner), LOCAL_TTL, data)
}

#[cfg(test)]
mod tests;
