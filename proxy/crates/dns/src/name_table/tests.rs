//! The name table's expansion and lookup rules, case by case as Istio's agent answers
//! them (istio/istio `pkg/dns/client/dns_test.go`'s table and cases, the proxy in `ns1`
//! with `ns1.svc.cluster.local svc.cluster.local cluster.local` as search domains).

use super::*;

fn info(ips: &[&str], registry: &str, ns: &str, short: &str) -> NameInfo {
    NameInfo {
        ips: ips.iter().map(|s| s.to_string()).collect(),
        registry: registry.into(),
        shortname: short.into(),
        namespace: ns.into(),
        alt_hosts: Vec::new(),
    }
}

fn external(ips: &[&str]) -> NameInfo {
    info(ips, "External", "", "")
}

fn kubernetes(ips: &[&str], ns: &str, short: &str) -> NameInfo {
    info(ips, "Kubernetes", ns, short)
}

fn scope() -> Scope {
    Scope::new(
        "ns1",
        "ns1.svc.cluster.local",
        vec![
            "ns1.svc.cluster.local".into(),
            "svc.cluster.local".into(),
            "cluster.local".into(),
        ],
    )
}

fn istio_table() -> NameTable {
    let mut table = HashMap::new();
    table.insert("www.google.com".into(), external(&["1.1.1.1"]));
    table.insert(
        "productpage.ns1.svc.cluster.local".into(),
        kubernetes(&["9.9.9.9"], "ns1", "productpage"),
    );
    table.insert(
        "example.ns2.svc.cluster.local".into(),
        kubernetes(&["10.10.10.10"], "ns2", "example"),
    );
    table.insert(
        "details.ns2.svc.cluster.remote".into(),
        kubernetes(
            &["11.11.11.11", "12.12.12.12", "13.13.13.13", "14.14.14.14"],
            "ns2",
            "details",
        ),
    );
    let mut alt = kubernetes(&["15.15.15.15"], "ns1", "svc-with-alt");
    alt.alt_hosts = vec!["svc-with-alt.ns1.svc.clusterset.local".into()];
    table.insert("svc-with-alt.ns1.svc.cluster.local".into(), alt);
    table.insert(
        "ipv6.localhost".into(),
        external(&["2001:db8:0:0:0:ff00:42:8329"]),
    );
    table.insert(
        "dual.localhost".into(),
        external(&["2.2.2.2", "2001:db8:0:0:0:ff00:42:8329"]),
    );
    table.insert("ipv4.localhost".into(), external(&["2.2.2.2"]));
    table.insert("*.b.wildcard".into(), external(&["11.11.11.11"]));
    table.insert("*.wildcard".into(), external(&["10.10.10.10"]));
    table.insert("*.svc.mesh.company.net".into(), external(&["10.1.2.3"]));
    table.insert("example.localhost.".into(), external(&["3.3.3.3"]));
    NameTable { table }
}

fn lookup_table() -> LookupTable {
    LookupTable::build(&istio_table(), &scope()).unwrap()
}

/// What a lookup answers, as `owner TYPE value` lines; `None` when forwarded.
fn answer(table: &LookupTable, qtype: RecordType, question: &str) -> Option<Vec<String>> {
    match table.lookup(qtype, question) {
        Lookup::Forward => None,
        Lookup::Local(records) => Some(
            records
                .iter()
                .map(|r| {
                    assert_eq!(r.ttl, LOCAL_TTL);
                    format!("{} {} {}", r.name, r.record_type(), r.data)
                })
                .collect(),
        ),
    }
}

fn a(table: &LookupTable, question: &str) -> Option<Vec<String>> {
    answer(table, RecordType::A, question)
}

fn lines(items: &[&str]) -> Option<Vec<String>> {
    Some(items.iter().map(|s| s.to_string()).collect())
}

#[test]
fn a_kubernetes_service_gets_its_short_forms_in_the_proxy_domain() {
    let set = |host: &str, info: &NameInfo| -> Vec<String> {
        alt_hosts(host, info, &scope()).into_iter().collect()
    };
    assert_eq!(
        set(
            "productpage.ns1.svc.cluster.local",
            &kubernetes(&["9.9.9.9"], "ns1", "productpage")
        ),
        [
            "productpage.",
            "productpage.ns1.",
            "productpage.ns1.svc.",
            "productpage.ns1.svc.cluster.local."
        ]
    );
    // Another namespace: no bare short name.
    assert_eq!(
        set(
            "example.ns2.svc.cluster.local",
            &kubernetes(&["10.10.10.10"], "ns2", "example")
        ),
        [
            "example.ns2.",
            "example.ns2.svc.",
            "example.ns2.svc.cluster.local."
        ]
    );
    // Another cluster's domain: only the FQDN, `details.ns2` would be ambiguous.
    assert_eq!(
        set(
            "details.ns2.svc.cluster.remote",
            &kubernetes(&["11.11.11.11"], "ns2", "details")
        ),
        ["details.ns2.svc.cluster.remote."]
    );
    let mut alt = kubernetes(&["15.15.15.15"], "ns1", "svc-with-alt");
    alt.alt_hosts = vec!["svc-with-alt.ns1.svc.clusterset.local".into()];
    assert_eq!(
        set("svc-with-alt.ns1.svc.cluster.local", &alt),
        [
            "svc-with-alt.",
            "svc-with-alt.ns1.",
            "svc-with-alt.ns1.svc.",
            "svc-with-alt.ns1.svc.cluster.local.",
            "svc-with-alt.ns1.svc.clusterset.local."
        ]
    );
    // ServiceEntry hosts and wildcards are themselves only.
    assert_eq!(
        set("*.wildcard", &external(&["10.10.10.10"])),
        ["*.wildcard."]
    );
    assert_eq!(
        set("example.localhost.", &external(&["3.3.3.3"])),
        ["example.localhost."]
    );
}

#[test]
fn kubernetes_names_answer_in_every_form_istio_expands() {
    let t = lookup_table();
    for q in [
        "productpage.ns1.svc.cluster.local.",
        "productpage.ns1.",
        "productpage.",
        "productpage.ns1.svc.",
    ] {
        assert_eq!(a(&t, q), lines(&[&format!("{q} A 9.9.9.9")]), "{q}");
    }
    for q in [
        "example.ns2.",
        "example.ns2.svc.",
        "example.ns2.svc.cluster.local.",
    ] {
        assert_eq!(a(&t, q), lines(&[&format!("{q} A 10.10.10.10")]), "{q}");
    }
    for q in [
        "svc-with-alt.",
        "svc-with-alt.ns1.",
        "svc-with-alt.ns1.svc.",
        "svc-with-alt.ns1.svc.cluster.local.",
        "svc-with-alt.ns1.svc.clusterset.local.",
    ] {
        assert_eq!(a(&t, q), lines(&[&format!("{q} A 15.15.15.15")]), "{q}");
    }
    let details = a(&t, "details.ns2.svc.cluster.remote.").unwrap();
    assert_eq!(details.len(), 4);
}

#[test]
fn short_names_outside_the_proxy_namespace_or_domain_are_forwarded() {
    let t = lookup_table();
    assert_eq!(a(&t, "example."), None);
    assert_eq!(a(&t, "details.ns2."), None);
    assert_eq!(a(&t, "www.bing.com."), None);
}

#[test]
fn the_first_search_domain_form_is_a_cname_to_the_name() {
    let t = lookup_table();
    assert_eq!(
        a(&t, "www.google.com.ns1.svc.cluster.local."),
        lines(&[
            "www.google.com.ns1.svc.cluster.local. CNAME www.google.com.",
            "www.google.com. A 1.1.1.1"
        ])
    );
    assert_eq!(
        a(&t, "productpage.ns1.ns1.svc.cluster.local."),
        lines(&[
            "productpage.ns1.ns1.svc.cluster.local. CNAME productpage.ns1.",
            "productpage.ns1. A 9.9.9.9"
        ])
    );
    // No AAAA for that service: the CNAME alone is not sent.
    assert_eq!(
        answer(
            &t,
            RecordType::AAAA,
            "productpage.ns1.ns1.svc.cluster.local."
        ),
        lines(&[])
    );
    // The FQDN under the search domain again is not a name of the table: forwarded,
    // and the upstream says NXDOMAIN (Istio's agent does not answer it itself).
    assert_eq!(
        a(
            &t,
            "productpage.ns1.svc.cluster.local.ns1.svc.cluster.local."
        ),
        None
    );
    assert_eq!(
        a(&t, "productpage.ns1.svc.cluster.local.cluster.local."),
        None
    );
}

#[test]
fn wildcards_answer_with_the_asked_name_and_the_most_specific_wins() {
    let t = lookup_table();
    assert_eq!(
        a(&t, "foo.wildcard."),
        lines(&["foo.wildcard. A 10.10.10.10"])
    );
    assert_eq!(
        a(&t, "a.b.wildcard."),
        lines(&["a.b.wildcard. A 11.11.11.11"])
    );
    assert_eq!(
        a(&t, "foo.foons.svc.mesh.company.net."),
        lines(&["foo.foons.svc.mesh.company.net. A 10.1.2.3"])
    );
    assert_eq!(
        a(&t, "foo.wildcard.ns1.svc.cluster.local."),
        lines(&[
            "foo.wildcard.ns1.svc.cluster.local. CNAME *.wildcard.",
            "*.wildcard. A 10.10.10.10"
        ])
    );
    // The bare parent is not covered by its wildcard.
    assert_eq!(a(&t, "wildcard."), None);
}

#[test]
fn a_name_without_the_asked_family_is_nodata_not_forwarded() {
    let t = lookup_table();
    assert_eq!(
        a(&t, "dual.localhost."),
        lines(&["dual.localhost. A 2.2.2.2"])
    );
    assert_eq!(
        answer(&t, RecordType::AAAA, "dual.localhost."),
        lines(&["dual.localhost. AAAA 2001:db8::ff00:42:8329"])
    );
    assert_eq!(a(&t, "ipv6.localhost."), lines(&[]));
    assert_eq!(answer(&t, RecordType::AAAA, "ipv4.localhost."), lines(&[]));
    // Other types about a mesh name go upstream, as in Istio.
    assert_eq!(answer(&t, RecordType::MX, "dual.localhost."), None);
    assert_eq!(answer(&t, RecordType::TXT, "productpage."), None);
}

#[test]
fn auto_allocated_addresses_answer_both_families() {
    // What istiod sends for a ServiceEntry with resolution NONE and no address, with
    // ISTIO_META_DNS_AUTO_ALLOCATE: one 240.240.0.0/16 and one 2001:2::/48 address.
    let mut table = HashMap::new();
    table.insert(
        "tcp-echo.external.test".into(),
        external(&["240.240.0.1", "2001:2::f0f0:1"]),
    );
    let t = LookupTable::build(&NameTable { table }, &scope()).unwrap();
    assert_eq!(
        a(&t, "tcp-echo.external.test."),
        lines(&["tcp-echo.external.test. A 240.240.0.1"])
    );
    assert_eq!(
        answer(&t, RecordType::AAAA, "tcp-echo.external.test."),
        lines(&["tcp-echo.external.test. AAAA 2001:2::f0f0:1"])
    );
}

#[test]
fn a_table_with_a_bad_address_or_host_is_refused_naming_it() {
    let mut table = HashMap::new();
    table.insert("ok.test".into(), external(&["1.2.3.4", "not-an-ip"]));
    let err = LookupTable::build(&NameTable { table }, &scope()).unwrap_err();
    assert_eq!(
        err.to_string(),
        r#"NameTable.table["ok.test"].ips[1]: "not-an-ip" is not an IP address"#
    );
    let mut table = HashMap::new();
    table.insert("".into(), external(&["1.2.3.4"]));
    let err = LookupTable::build(&NameTable { table }, &scope()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with(r#"NameTable.table[""]: not a DNS name"#),
        "{err}"
    );
}

#[test]
fn without_search_domains_there_are_no_cnames() {
    let scope = Scope::new("ns1", "ns1.svc.cluster.local", Vec::new());
    let t = LookupTable::build(&istio_table(), &scope).unwrap();
    assert_eq!(a(&t, "www.google.com.ns1.svc.cluster.local."), None);
    assert_eq!(a(&t, "productpage."), lines(&["productpage. A 9.9.9.9"]));
}
