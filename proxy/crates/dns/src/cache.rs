//! The cache of forwarded answers, so a repeated query is not sent upstream again while
//! its answer is still valid.
//!
//! An answer is kept for the smallest TTL of its records; a negative answer (NXDOMAIN,
//! or NOERROR with no answer) for its SOA's negative TTL (RFC 2308: the smaller of the
//! SOA record's TTL and its MINIMUM), and not at all without one. SERVFAIL and other
//! errors, and truncated answers, are never kept. Served from the cache, an answer's
//! TTLs count down by the time it has been kept. The cache holds at most `capacity`
//! answers: when full, expired ones go first, else the one that expires soonest.
//!
//! Istio's agent has no cache; it is ours, because every app query not for the mesh
//! would otherwise cost an upstream round trip.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, RecordType};

/// What makes two queries the same for the cache.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    /// Lower case.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// The query had EDNS, and the DO bit: both change what an answer carries.
    pub edns: bool,
    pub dnssec_ok: bool,
    pub checking_disabled: bool,
}

impl Key {
    pub fn of(query: &Message) -> Option<Key> {
        let question = query.queries.first()?;
        Some(Key {
            name: question.name().to_ascii().to_ascii_lowercase(),
            qtype: question.query_type().into(),
            qclass: question.query_class().into(),
            edns: query.edns.is_some(),
            dnssec_ok: query.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok),
            checking_disabled: query.metadata.checking_disabled,
        })
    }
}

struct Entry {
    message: Message,
    stored: Instant,
    expires: Instant,
}

pub struct Cache {
    entries: Mutex<HashMap<Key, Entry>>,
    capacity: usize,
}

impl Cache {
    pub fn new(capacity: usize) -> Cache {
        Cache {
            entries: Mutex::new(HashMap::new()),
            capacity,
        }
    }

    /// The kept answer to `key`, its TTLs counted down, if it has not expired.
    pub fn get(&self, key: &Key) -> Option<Message> {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let entry = entries.get(key)?;
        if entry.expires <= now {
            entries.remove(key);
            return None;
        }
        let elapsed = now.duration_since(entry.stored).as_secs() as u32;
        let mut message = entry.message.clone();
        for record in message
            .answers
            .iter_mut()
            .chain(message.authorities.iter_mut())
            .chain(message.additionals.iter_mut())
        {
            record.ttl = record.ttl.saturating_sub(elapsed);
        }
        Some(message)
    }

    /// Keeps `answer` for `key` if it may be kept.
    pub fn put(&self, key: Key, answer: &Message) {
        if self.capacity == 0 {
            return;
        }
        let Some(ttl) = cacheable_ttl(answer) else {
            return;
        };
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            entries.retain(|_, e| e.expires > now);
            if entries.len() >= self.capacity
                && let Some(soonest) = entries
                    .iter()
                    .min_by_key(|(_, e)| e.expires)
                    .map(|(k, _)| k.clone())
            {
                entries.remove(&soonest);
            }
        }
        entries.insert(
            key,
            Entry {
                message: answer.clone(),
                stored: now,
                expires: now + Duration::from_secs(ttl.into()),
            },
        );
    }

    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// How long `answer` may be kept, or `None` if it may not be.
fn cacheable_ttl(answer: &Message) -> Option<u32> {
    if answer.metadata.truncation {
        return None;
    }
    let negative = match answer.metadata.response_code {
        ResponseCode::NXDomain => true,
        ResponseCode::NoError => answer.answers.is_empty(),
        _ => return None,
    };
    let ttl = if negative {
        answer.authorities.iter().find_map(|r| match &r.data {
            RData::SOA(soa) => Some(r.ttl.min(soa.minimum)),
            _ => None,
        })?
    } else {
        answer
            .answers
            .iter()
            .chain(answer.authorities.iter())
            .filter(|r| r.record_type() != RecordType::OPT)
            .map(|r| r.ttl)
            .min()?
    };
    (ttl > 0).then_some(ttl)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use hickory_proto::op::{MessageType, OpCode, Query};
    use hickory_proto::rr::rdata::{A, SOA};
    use hickory_proto::rr::{Name, Record};

    use super::*;

    fn answer(code: ResponseCode, ttls: &[u32]) -> Message {
        let name = Name::from_ascii("upstream-only.test.").unwrap();
        let mut m = Message::new(7, MessageType::Response, OpCode::Query);
        m.metadata.response_code = code;
        m.add_query(Query::query(name.clone(), RecordType::A));
        for (i, ttl) in ttls.iter().enumerate() {
            m.add_answer(Record::from_rdata(
                name.clone(),
                *ttl,
                RData::A(A(Ipv4Addr::new(192, 0, 2, i as u8))),
            ));
        }
        m
    }

    fn key(name: &str) -> Key {
        Key {
            name: name.into(),
            qtype: 1,
            qclass: 1,
            edns: false,
            dnssec_ok: false,
            checking_disabled: false,
        }
    }

    #[test]
    fn an_answer_lives_for_its_smallest_ttl() {
        assert_eq!(
            cacheable_ttl(&answer(ResponseCode::NoError, &[300, 60])),
            Some(60)
        );
        assert_eq!(cacheable_ttl(&answer(ResponseCode::NoError, &[0])), None);
        assert_eq!(cacheable_ttl(&answer(ResponseCode::ServFail, &[300])), None);
        let mut truncated = answer(ResponseCode::NoError, &[300]);
        truncated.metadata.truncation = true;
        assert_eq!(cacheable_ttl(&truncated), None);
    }

    #[test]
    fn a_negative_answer_lives_for_its_soa_minimum_or_not_at_all() {
        let mut nx = answer(ResponseCode::NXDomain, &[]);
        assert_eq!(cacheable_ttl(&nx), None);
        let zone = Name::from_ascii("test.").unwrap();
        nx.add_authority(Record::from_rdata(
            zone.clone(),
            3600,
            RData::SOA(SOA::new(zone.clone(), zone, 1, 60, 60, 60, 10)),
        ));
        assert_eq!(cacheable_ttl(&nx), Some(10));
    }

    #[test]
    fn a_full_cache_drops_the_answer_that_expires_soonest() {
        let cache = Cache::new(2);
        cache.put(key("a."), &answer(ResponseCode::NoError, &[100]));
        cache.put(key("b."), &answer(ResponseCode::NoError, &[5]));
        cache.put(key("c."), &answer(ResponseCode::NoError, &[100]));
        assert_eq!(cache.len(), 2);
        assert!(cache.get(&key("a.")).is_some());
        assert!(cache.get(&key("b.")).is_none());
        assert!(cache.get(&key("c.")).is_some());
        assert!(cache.get(&key("d.")).is_none());
    }
}
