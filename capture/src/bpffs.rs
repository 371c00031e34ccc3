//! Where capture keeps its state under the bpffs root (`<root>/pods/pod_<netns inode>/`
//! for a pod's links, `<root>/node/` for node mode's) and the shared maps opened from
//! their pins: the lowest layer, used by installing, inspecting and the decision events.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::Context;
use aya::{
    Pod,
    maps::{HashMap, LpmTrie, Map, MapData},
};
use shunt_common::{AF_INET, AF_INET6, Addr};

/// Where a pod's links are pinned.
pub fn pod_dir(root: &Path, pod_id: u32) -> PathBuf {
    root.join("pods").join(format!("pod_{pod_id}"))
}

/// An address as the maps hold it: four native-endian words and the family.
pub fn addr_words(ip: &IpAddr) -> (Addr, u32) {
    match ip {
        IpAddr::V4(v4) => ([u32::from_ne_bytes(v4.octets()), 0, 0, 0], AF_INET),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            ([w(0), w(4), w(8), w(12)], AF_INET6)
        }
    }
}

/// The address the maps' words and family stand for.
pub fn words_addr(addr: &Addr, family: u32) -> IpAddr {
    if family == AF_INET {
        IpAddr::from(addr[0].to_ne_bytes())
    } else {
        let mut o = [0u8; 16];
        for (i, w) in addr.iter().enumerate() {
            o[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        IpAddr::from(o)
    }
}

/// The shared maps, opened from their pins.
pub(crate) struct Maps<'a> {
    pub(crate) root: &'a Path,
}

impl Maps<'_> {
    pub(crate) fn map(&self, name: &str) -> anyhow::Result<Map> {
        let path = self.root.join(name);
        let data = MapData::from_pin(&path)
            .with_context(|| format!("opening pinned map {}", path.display()))?;
        Ok(Map::from_map_data(data)?)
    }
    pub(crate) fn hash<K: Pod, V: Pod>(
        &self,
        name: &str,
    ) -> anyhow::Result<HashMap<MapData, K, V>> {
        Ok(HashMap::try_from(self.map(name)?)?)
    }
    pub(crate) fn lpm<K: Pod, V: Pod>(&self, name: &str) -> anyhow::Result<LpmTrie<MapData, K, V>> {
        Ok(LpmTrie::try_from(self.map(name)?)?)
    }
}

/// Where node mode pins its own programs' links.
pub fn node_dir(root: &Path) -> PathBuf {
    root.join("node")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_through_map_words() {
        for s in ["10.0.0.7", "fd00::1:2", "::ffff:1.2.3.4"] {
            let ip: IpAddr = s.parse().unwrap();
            let (words, family) = addr_words(&ip);
            assert_eq!(words_addr(&words, family), ip);
        }
    }
}
