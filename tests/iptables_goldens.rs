//! Golden parity with istio-iptables: each of its 27 golden outputs
//! (`fixtures/istio/iptables/*.golden`, configs in `run_test.go.txt`) is rendered by the
//! real `shunt capture --backend iptables --dry-run` from the flags and environment that
//! make the same config, and compared rule for rule: per IP family, table and chain,
//! the rules in order (`-I` applied at its position) and the chains created. Whitespace,
//! table order and iptables-save's header lines do not matter.

use std::collections::{BTreeMap, BTreeSet};

use harness::shunt_bin;

/// One golden: its name and what reproduces `run_test.go.txt`'s config for it, on top of
/// the test's base config (`constructTestConfig`: no inbound or outbound capture, IPv4
/// only, uid/gid 1337, tunnel port 15008).
struct Golden {
    name: &'static str,
    flags: &'static [(&'static str, &'static str)],
    env: &'static [(&'static str, &'static str)],
}

/// `constructTestConfig`'s fields as flags; a golden's own flags replace these.
const BASE: [(&str, &str); 8] = [
    ("-p", "15001"),
    ("-z", "15006"),
    ("-e", "15008"),
    ("-u", "1337"),
    ("-i", ""),
    ("-b", ""),
    ("-d", ""),
    ("--enable-inbound-ipv6", "false"),
];

const IPV6: (&str, &str) = ("--enable-inbound-ipv6", "true");
const DNS: (&str, &str) = ("--redirect-dns", "true");
/// `RedirectDNS` with no `DNSServersV4/V6`: an empty list, not the host's resolv.conf.
const NO_DNS_SERVERS: (&str, &str) = ("--dns-servers-v4", "");

const GOLDENS: [Golden; 27] = [
    Golden {
        name: "ipv6-empty-inbound-ports",
        flags: &[IPV6],
        env: &[],
    },
    Golden {
        name: "ip-range",
        flags: &[
            ("-x", "1.1.0.0/16"),
            ("-i", "9.9.0.0/16"),
            DNS,
            ("-g", "1,2"),
            ("-u", "3,4"),
            ("--dns-servers-v4", "127.0.0.53"),
        ],
        env: &[],
    },
    Golden {
        name: "tproxy",
        flags: &[
            ("-m", "TPROXY"),
            ("-b", "*"),
            ("-x", "1.1.0.0/16"),
            ("-i", "9.9.0.0/16"),
            DNS,
            ("--dns-servers-v4", "127.0.0.53"),
            ("-g", "1337"),
            ("-u", "1337"),
            ("-c", "not-istio-nic"),
            IPV6,
        ],
        env: &[],
    },
    Golden {
        name: "ipv6-inbound-ports",
        flags: &[("-b", "4000,5000"), IPV6],
        env: &[],
    },
    Golden {
        name: "ipv6-virt-interfaces",
        flags: &[("-b", "4000,5000"), ("-k", "eth0,eth1"), IPV6],
        env: &[],
    },
    Golden {
        name: "ipv6-ipnets",
        flags: &[
            ("-b", "4000,5000"),
            ("-d", "6000,7000,"),
            ("-k", "eth0,eth1"),
            ("-x", "2001:db8::/32"),
            ("-i", "2001:db8::/32"),
            IPV6,
        ],
        env: &[],
    },
    Golden {
        name: "ipv6-uid-gid",
        flags: &[
            ("-b", "4000,5000"),
            ("-d", "6000,7000"),
            ("-k", "eth0,eth1"),
            ("-g", "1,2"),
            ("-u", "3,4"),
            IPV6,
            ("-x", "2001:db8::/32"),
            ("-i", "2001:db8::/32"),
        ],
        env: &[],
    },
    Golden {
        name: "ipv6-outbound-ports",
        flags: &[("-q", "32000,31000"), IPV6],
        env: &[],
    },
    Golden {
        name: "empty",
        flags: &[],
        env: &[],
    },
    Golden {
        name: "kube-virt-interfaces",
        flags: &[("-k", "eth1,eth2"), ("-i", "*")],
        env: &[],
    },
    Golden {
        name: "ipnets",
        flags: &[("-i", "10.0.0.0/8")],
        env: &[],
    },
    Golden {
        name: "ipnets-with-kube-virt-interfaces",
        flags: &[("-k", "eth1,eth2"), ("-i", "10.0.0.0/8")],
        env: &[],
    },
    Golden {
        name: "inbound-ports-include",
        flags: &[("-b", "32000,31000")],
        env: &[],
    },
    Golden {
        name: "inbound-ports-wildcard",
        flags: &[("-b", "*")],
        env: &[],
    },
    Golden {
        name: "inbound-ports-tproxy",
        flags: &[("-b", "32000,31000"), ("-m", "TPROXY")],
        env: &[],
    },
    Golden {
        name: "inbound-ports-wildcard-tproxy",
        flags: &[("-b", "*"), ("-m", "TPROXY")],
        env: &[],
    },
    Golden {
        name: "dns-uid-gid",
        flags: &[
            DNS,
            ("--dns-servers-v4", "127.0.0.53"),
            ("--dns-servers-v6", "::127.0.0.53"),
            ("-g", "1,2"),
            ("-u", "3,4"),
            IPV6,
        ],
        env: &[],
    },
    Golden {
        name: "ipv6-dns-uid-gid",
        flags: &[IPV6, DNS, NO_DNS_SERVERS, ("-g", "1,2"), ("-u", "3,4")],
        env: &[],
    },
    Golden {
        name: "outbound-owner-groups",
        flags: &[],
        // Istio sets owner groups through the environment only.
        env: &[("ISTIO_OUTBOUND_OWNER_GROUPS", "java,202")],
    },
    Golden {
        name: "outbound-owner-groups-exclude",
        flags: &[],
        env: &[("ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE", "888,ftp")],
    },
    Golden {
        name: "ipv6-dns-outbound-owner-groups",
        flags: &[
            IPV6,
            DNS,
            NO_DNS_SERVERS,
            ("--outbound-owner-groups", "java,202"),
        ],
        env: &[],
    },
    Golden {
        name: "ipv6-dns-outbound-owner-groups-exclude",
        flags: &[
            IPV6,
            NO_DNS_SERVERS,
            ("--outbound-owner-groups-exclude", "888,ftp"),
        ],
        // istio-iptables' other name for --redirect-dns.
        env: &[("ISTIO_META_DNS_CAPTURE", "true")],
    },
    Golden {
        name: "outbound-ports-include",
        flags: &[("-q", "32000,31000")],
        env: &[],
    },
    Golden {
        name: "loopback-outbound-iprange",
        flags: &[
            ("-i", "127.1.2.3/32"),
            DNS,
            ("--dns-servers-v4", "127.0.0.53"),
            ("-g", "1,2"),
            ("-u", "3,4"),
        ],
        env: &[],
    },
    Golden {
        name: "basic-exclude-nic",
        flags: &[("-c", "not-istio-nic")],
        env: &[],
    },
    Golden {
        name: "drop-invalid",
        flags: &[("--drop-invalid", "true")],
        env: &[],
    },
    Golden {
        name: "host-ipv4-loopback-cidr",
        flags: &[],
        env: &[("ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR", "127.0.0.1/8")],
    },
];

/// One table of one family: the chains it creates and each chain's rules in order.
#[derive(Debug, Default, PartialEq)]
struct Table {
    created: BTreeSet<String>,
    chains: BTreeMap<String, Vec<String>>,
}

/// Families in order (IPv4, then IPv6), each table by name.
type Families = Vec<BTreeMap<String, Table>>;

fn words(s: &str) -> Vec<&str> {
    s.split_whitespace().collect()
}

/// Applies one restore line to its table.
fn apply(table: &mut Table, line: &str, context: &str) {
    let w = words(line);
    match w.as_slice() {
        ["-N", chain] => {
            table.created.insert(chain.to_string());
        }
        ["-A", chain, spec @ ..] => table
            .chains
            .entry(chain.to_string())
            .or_default()
            .push(spec.join(" ")),
        ["-I", chain, pos, spec @ ..] => {
            let pos: usize = pos.parse().unwrap_or_else(|_| panic!("{context}: {line}"));
            let rules = table.chains.entry(chain.to_string()).or_default();
            assert!(pos >= 1 && pos <= rules.len() + 1, "{context}: {line}");
            rules.insert(pos - 1, spec.join(" "));
        }
        _ => panic!("{context}: unexpected line {line:?}"),
    }
}

/// Where one IP family's rules end and the next one's begin.
#[derive(Clone, Copy)]
enum Split {
    /// shunt's dry run: at `# ip6tables-restore`.
    Marker,
    /// A golden: where the table order starts over (istio-iptables prints each family's
    /// tables sorted, IPv4 first).
    TableOrder,
}

/// iptables-restore text, split into families.
fn parse(text: &str, split: Split, context: &str) -> Families {
    let mut families: Families = vec![BTreeMap::new()];
    let mut table: Option<String> = None;
    let mut last_table = String::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.starts_with("# ip6tables") {
            families.push(BTreeMap::new());
            last_table.clear();
            continue;
        }
        if line.starts_with('#') || line == "iptables-save" || line == "ip6tables-save" {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            let name = name.trim().to_owned();
            if matches!(split, Split::TableOrder) && !last_table.is_empty() && name <= last_table {
                families.push(BTreeMap::new());
            }
            last_table = name.clone();
            table = Some(name);
            continue;
        }
        if line == "COMMIT" {
            table = None;
            continue;
        }
        let name = table
            .as_ref()
            .unwrap_or_else(|| panic!("{context}: rule outside a table: {line}"));
        let family = families.last_mut().unwrap();
        apply(family.entry(name.clone()).or_default(), line, context);
    }
    families.retain(|f| !f.is_empty());
    families
}

/// A line-by-line diff (longest common subsequence): `  ` same, `- ` only in the
/// golden, `+ ` only in shunt's.
fn diff(want: &[String], got: &[String]) -> String {
    let (n, m) = (want.len(), got.len());
    let mut lcs = vec![vec![0usize; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if want[i] == got[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, String::new());
    while i < n || j < m {
        if i < n && j < m && want[i] == got[j] {
            out += &format!("      {}\n", want[i]);
            i += 1;
            j += 1;
        } else if j < m && (i == n || lcs[i][j + 1] >= lcs[i + 1][j]) {
            out += &format!("    + {}\n", got[j]);
            j += 1;
        } else {
            out += &format!("    - {}\n", want[i]);
            i += 1;
        }
    }
    out
}

/// Every difference between the golden and shunt's rendering, readable.
fn compare(want: &Families, got: &Families) -> Vec<String> {
    let mut problems = Vec::new();
    let family_name = |i: usize| if i == 0 { "IPv4" } else { "IPv6" };
    if want.len() != got.len() {
        problems.push(format!(
            "golden has {} IP families, shunt rendered {}",
            want.len(),
            got.len()
        ));
    }
    let empty = BTreeMap::new();
    for f in 0..want.len().max(got.len()) {
        let (w, g) = (want.get(f).unwrap_or(&empty), got.get(f).unwrap_or(&empty));
        let tables: BTreeSet<&String> = w.keys().chain(g.keys()).collect();
        let none = Table::default();
        for t in tables {
            let (wt, gt) = (w.get(t).unwrap_or(&none), g.get(t).unwrap_or(&none));
            if wt.created != gt.created {
                problems.push(format!(
                    "{} {t}: chains created: golden {:?}, shunt {:?}",
                    family_name(f),
                    wt.created,
                    gt.created
                ));
            }
            let chains: BTreeSet<&String> = wt.chains.keys().chain(gt.chains.keys()).collect();
            let no_rules = Vec::new();
            for c in chains {
                let wr = wt.chains.get(c).unwrap_or(&no_rules);
                let gr = gt.chains.get(c).unwrap_or(&no_rules);
                if wr != gr {
                    problems.push(format!(
                        "{} {t} {c} (- golden only, + shunt only):\n{}",
                        family_name(f),
                        diff(wr, gr)
                    ));
                }
            }
        }
    }
    problems
}

/// `shunt capture --backend iptables --dry-run` with the golden's flags on the base's.
fn render(golden: &Golden) -> String {
    let mut args: Vec<String> = ["capture", "--backend", "iptables", "--dry-run"]
        .map(String::from)
        .to_vec();
    let flags = BASE
        .iter()
        .filter(|(f, _)| !golden.flags.iter().any(|(g, _)| g == f))
        .chain(golden.flags);
    for (flag, value) in flags {
        if flag.starts_with("--") {
            // `--flag=value`: booleans take their value only this way.
            args.push(format!("{flag}={value}"));
        } else {
            args.push(flag.to_string());
            args.push(value.to_string());
        }
    }
    let out = std::process::Command::new(shunt_bin())
        .args(&args)
        .env_clear()
        .envs(golden.env.iter().copied())
        .output()
        .expect("run shunt capture");
    assert!(
        out.status.success(),
        "{}: shunt {} failed: {}",
        golden.name,
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_istio_iptables_golden_is_rendered_rule_for_rule() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/istio/iptables");
    let on_disk: BTreeSet<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.strip_suffix(".golden").map(String::from)
        })
        .collect();
    let covered: BTreeSet<String> = GOLDENS.iter().map(|g| g.name.to_owned()).collect();
    assert_eq!(
        on_disk, covered,
        "every golden has a row, every row a golden"
    );

    let mut failures = Vec::new();
    for golden in &GOLDENS {
        let text = std::fs::read_to_string(dir.join(format!("{}.golden", golden.name))).unwrap();
        let want = parse(&text, Split::TableOrder, golden.name);
        let got = parse(&render(golden), Split::Marker, golden.name);
        assert!(
            !want.is_empty(),
            "{}: the golden holds no rules",
            golden.name
        );
        let problems = compare(&want, &got);
        if !problems.is_empty() {
            failures.push(format!("== {}\n{}", golden.name, problems.join("\n")));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} goldens differ:\n{}",
        failures.len(),
        GOLDENS.len(),
        failures.join("\n")
    );
}

/// The comparison itself: order within a chain and the rules themselves count; table
/// order and whitespace do not.
#[test]
fn the_comparison_sees_order_and_ignores_layout() {
    let golden = "iptables-save\n* nat\n-N ISTIO_OUTPUT\n-A ISTIO_OUTPUT -d 10.0.0.0/8 -j RETURN\n\
                  -A ISTIO_OUTPUT -j ISTIO_REDIRECT\nCOMMIT\n* raw\n-A OUTPUT -j CT --zone 1\nCOMMIT\n";
    let same = "# iptables-restore --noflush\n*raw\n-A OUTPUT  -j CT --zone 1\nCOMMIT\n*nat\n\
                -N ISTIO_OUTPUT\n-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n-I ISTIO_OUTPUT 1 -d 10.0.0.0/8 -j RETURN\nCOMMIT\n";
    let swapped = "*nat\n-N ISTIO_OUTPUT\n-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n\
                   -A ISTIO_OUTPUT -d 10.0.0.0/8 -j RETURN\nCOMMIT\n*raw\n-A OUTPUT -j CT --zone 1\nCOMMIT\n";
    let want = parse(golden, Split::TableOrder, "golden");
    assert!(compare(&want, &parse(same, Split::Marker, "same")).is_empty());
    let problems = compare(&want, &parse(swapped, Split::Marker, "swapped"));
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert!(
        problems[0].contains("- -j ISTIO_REDIRECT") || problems[0].contains("+ -j ISTIO_REDIRECT"),
        "{}",
        problems[0]
    );
}

fn dry_run(args: &[&str], env: &[(&str, &str)]) -> Result<String, String> {
    let out = std::process::Command::new(shunt_bin())
        .args(["capture", "--backend", "iptables", "--dry-run"])
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("run shunt capture");
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// istio-init's environment (SEEDS.md section 1) configures shunt as its command line does.
#[test]
fn the_seeds_environment_renders_what_its_command_line_does() {
    let flags = dry_run(
        &[
            "-p",
            "15001",
            "-z",
            "15006",
            "-u",
            "1337",
            "-m",
            "REDIRECT",
            "-i",
            "*",
            "-x",
            "",
            "-b",
            "*",
            "-d",
            "15090,15021,15020",
        ],
        &[],
    )
    .unwrap();
    let env = dry_run(
        &[],
        &[
            ("PROXY_PORT", "15001"),
            ("PROXY_INBOUND_CAPTURE_PORT", "15006"),
            ("PROXY_UID", "1337"),
            ("PROXY_GID", "1337"),
            ("INBOUND_INTERCEPTION_MODE", "REDIRECT"),
            ("INBOUND_TPROXY_MARK", "1337"),
            ("INBOUND_TPROXY_ROUTE_TABLE", "133"),
            ("INBOUND_PORTS_INCLUDE", "*"),
            ("INBOUND_PORTS_EXCLUDE", "15090,15021,15020"),
            ("OUTBOUND_IP_RANGES_INCLUDE", "*"),
            ("OUTBOUND_IP_RANGES_EXCLUDE", ""),
            ("OUTBOUND_PORTS_EXCLUDE", ""),
        ],
    )
    .unwrap();
    assert_eq!(env, flags);
    // And a different environment does change them.
    let other = dry_run(&[], &[("INBOUND_PORTS_EXCLUDE", "15090")]).unwrap();
    assert_ne!(other, flags);
}

/// istio-iptables' precedence: the command line, then ISTIO_META_DNS_CAPTURE (its
/// additional name), then REDIRECT_DNS.
#[test]
fn dns_capture_follows_istio_iptables_precedence() {
    let servers = ("DNS_SERVERS_V4", "10.96.0.10");
    let dns_on = |args: &[&str], env: &[(&str, &str)]| {
        let mut env = env.to_vec();
        env.push(servers);
        dry_run(args, &env).unwrap().contains("ISTIO_OUTPUT_DNS")
    };
    assert!(!dns_on(&[], &[]));
    assert!(dns_on(&[], &[("REDIRECT_DNS", "true")]));
    assert!(!dns_on(
        &[],
        &[
            ("REDIRECT_DNS", "true"),
            ("ISTIO_META_DNS_CAPTURE", "false")
        ]
    ));
    assert!(dns_on(
        &["--redirect-dns"],
        &[("ISTIO_META_DNS_CAPTURE", "false")]
    ));
    assert!(!dns_on(
        &["--redirect-dns=false"],
        &[("REDIRECT_DNS", "true")]
    ));
    let err = dry_run(&[], &[("REDIRECT_DNS", "sure"), servers]).unwrap_err();
    assert!(
        err.contains("--redirect-dns (env REDIRECT_DNS): 'sure'"),
        "{err}"
    );
}
