//! Envoy's `FractionalPercent` as filters use it to decide whether they act on a
//! request (fault's delays and aborts, CORS's and ext_authz's `filter_enabled`).

use envoy_types::pb::envoy::r#type::v3::FractionalPercent;

/// Envoy's `FractionalPercent`: `numerator` out of `denominator` (100, 10 000 or
/// 1 000 000). An absent percentage is the proto default: 0 %.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Percent {
    pub numerator: u64,
    pub denominator: u64,
}

impl Percent {
    pub fn from_proto(p: Option<&FractionalPercent>) -> Percent {
        let Some(p) = p else {
            return Percent {
                numerator: 0,
                denominator: 100,
            };
        };
        let denominator = match p.denominator {
            1 => 10_000,
            2 => 1_000_000,
            _ => 100,
        };
        Percent {
            numerator: u64::from(p.numerator),
            denominator,
        }
    }

    /// Envoy's `featureEnabled`: a uniform draw modulo the denominator below the
    /// numerator (a numerator above the denominator is always on).
    pub fn hit(&self, random: u64) -> bool {
        random % self.denominator < self.numerator
    }

    /// The percentage header's value lowers the numerator, never raises it; an
    /// unparsable header leaves the configured one.
    pub fn capped_by(self, header: Option<std::borrow::Cow<'_, str>>) -> Percent {
        match header.and_then(|h| h.trim().parse::<u64>().ok()) {
            Some(n) => Percent {
                numerator: n.min(self.numerator),
                ..self
            },
            None => self,
        }
    }
}
