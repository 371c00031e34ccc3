//! istio-iptables' rule builder: rules collected per family in the order they are
//! added, rendered as iptables-restore input the way istio-iptables renders it (tables
//! sorted, each table's new chains first, then its rules in order, `-I` kept as `-I`).

use super::Family;

/// iptables' built-in chains and targets: never created, never deleted.
pub const BUILT_IN: [&str; 8] = [
    "INPUT",
    "OUTPUT",
    "FORWARD",
    "PREROUTING",
    "POSTROUTING",
    "ACCEPT",
    "RETURN",
    "DROP",
];

pub fn is_built_in(chain: &str) -> bool {
    BUILT_IN.contains(&chain)
}

/// One rule: its table and chain, and the whole `-A CHAIN ...` / `-I CHAIN N ...` line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub table: &'static str,
    pub chain: String,
    pub line: String,
}

impl Rule {
    /// The rule's matches and target, without `-A CHAIN` / `-I CHAIN N`.
    pub fn spec(&self) -> &str {
        let skip = if self.line.starts_with("-I ") { 3 } else { 2 };
        let mut rest = self.line.as_str();
        for _ in 0..skip {
            rest = rest.trim_start();
            rest = rest.find(' ').map_or("", |i| &rest[i..]);
        }
        rest.trim()
    }

    /// The chain this rule jumps to, when its last words are `-j CHAIN`.
    pub fn jump_target(&self) -> Option<&str> {
        let words: Vec<&str> = self.line.split_whitespace().collect();
        match words.as_slice() {
            [.., "-j", target] => Some(target),
            _ => None,
        }
    }
}

#[derive(Debug, Default)]
pub struct Builder {
    pub v4: Vec<Rule>,
    pub v6: Vec<Rule>,
    ipv6: bool,
}

impl Builder {
    pub fn new(ipv6: bool) -> Self {
        Builder {
            ipv6,
            ..Default::default()
        }
    }

    fn list(&mut self, family: Family) -> Option<&mut Vec<Rule>> {
        match family {
            Family::V4 => Some(&mut self.v4),
            Family::V6 if self.ipv6 => Some(&mut self.v6),
            Family::V6 => None,
        }
    }

    pub fn append_to(&mut self, family: Family, table: &'static str, chain: &str, spec: &str) {
        if let Some(list) = self.list(family) {
            list.push(Rule {
                table,
                chain: chain.to_owned(),
                line: format!("-A {chain} {spec}"),
            });
        }
    }

    pub fn insert_to(
        &mut self,
        family: Family,
        table: &'static str,
        chain: &str,
        position: usize,
        spec: &str,
    ) {
        if let Some(list) = self.list(family) {
            list.push(Rule {
                table,
                chain: chain.to_owned(),
                line: format!("-I {chain} {position} {spec}"),
            });
        }
    }

    /// The same rule for both families.
    pub fn append(&mut self, table: &'static str, chain: &str, spec: &str) {
        for family in [Family::V4, Family::V6] {
            self.append_to(family, table, chain, spec);
        }
    }

    pub fn insert(&mut self, table: &'static str, chain: &str, position: usize, spec: &str) {
        for family in [Family::V4, Family::V6] {
            self.insert_to(family, table, chain, position, spec);
        }
    }

    /// A rule that differs per family only by an address: `spec` gets the family's.
    pub fn append_versioned(
        &mut self,
        table: &'static str,
        chain: &str,
        v4: &str,
        v6: &str,
        spec: impl Fn(&str) -> String,
    ) {
        self.append_to(Family::V4, table, chain, &spec(v4));
        self.append_to(Family::V6, table, chain, &spec(v6));
    }

    pub fn rules(&self, family: Family) -> &[Rule] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }

    /// The iptables-restore input for one family (empty when it has no rules).
    pub fn restore(&self, family: Family) -> String {
        let rules = self.rules(family);
        let mut tables: Vec<&'static str> = rules.iter().map(|r| r.table).collect();
        tables.sort_unstable();
        tables.dedup();
        let mut out = String::new();
        for table in tables {
            let in_table: Vec<&Rule> = rules.iter().filter(|r| r.table == table).collect();
            out.push_str(&format!("*{table}\n"));
            let mut chains: Vec<&str> = Vec::new();
            // Chains with rules, in order, then chains only jumped to.
            let named = in_table.iter().map(|r| r.chain.as_str());
            let jumped = in_table.iter().filter_map(|r| r.jump_target());
            for chain in named.chain(jumped) {
                if !is_built_in(chain) && !chains.contains(&chain) {
                    chains.push(chain);
                }
            }
            for chain in chains {
                out.push_str(&format!("-N {chain}\n"));
            }
            for rule in in_table {
                out.push_str(&rule.line);
                out.push('\n');
            }
            out.push_str("COMMIT\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_sorts_tables_and_declares_chains_before_rules() {
        let mut b = Builder::new(false);
        b.append("nat", "ISTIO_OUTPUT", "-j ISTIO_REDIRECT");
        b.append("mangle", "PREROUTING", "-j ISTIO_DROP");
        b.insert("nat", "PREROUTING", 1, "-i eth1 -j RETURN");
        b.append(
            "nat",
            "ISTIO_REDIRECT",
            "-p tcp -j REDIRECT --to-ports 15001",
        );
        assert_eq!(
            b.restore(Family::V4),
            "*mangle\n-N ISTIO_DROP\n-A PREROUTING -j ISTIO_DROP\nCOMMIT\n\
             *nat\n-N ISTIO_OUTPUT\n-N ISTIO_REDIRECT\n-A ISTIO_OUTPUT -j ISTIO_REDIRECT\n\
             -I PREROUTING 1 -i eth1 -j RETURN\n\
             -A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001\nCOMMIT\n"
        );
        assert_eq!(b.restore(Family::V6), "", "IPv6 off: no IPv6 rules");
        assert_eq!(b.v4[2].spec(), "-i eth1 -j RETURN");
        assert_eq!(b.v4[0].spec(), "-j ISTIO_REDIRECT");
    }
}
