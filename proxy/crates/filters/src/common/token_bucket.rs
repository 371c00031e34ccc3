//! Envoy's token bucket for the local rate limit filters (HTTP and network): starts
//! full at `max_tokens`, refills `tokens_per_fill` every `fill_interval` (continuously,
//! as Envoy's atomic bucket), and each request or connection takes one token.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::r#type::v3::TokenBucket as EnvoyTokenBucket;
use shunt_config::{Diagnostics, JsonPath, convert};

#[derive(Debug)]
pub struct TokenBucket {
    pub max_tokens: u32,
    tokens_per_fill: u32,
    fill_interval: Duration,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    tokens: f64,
    refilled: Instant,
}

impl TokenBucket {
    pub fn compile(
        b: &EnvoyTokenBucket,
        path: &JsonPath,
        problems: &mut Diagnostics,
    ) -> Option<TokenBucket> {
        let Some(interval) = &b.fill_interval else {
            problems.error(path.field("fill_interval"), "is required");
            return None;
        };
        let fill_interval = convert::duration(interval, &path.field("fill_interval"), problems)?;
        if fill_interval < Duration::from_millis(50) {
            problems.error(path.field("fill_interval"), "must be at least 50ms");
            return None;
        }
        if b.max_tokens == 0 {
            problems.error(path.field("max_tokens"), "must be above 0");
            return None;
        }
        Some(TokenBucket::new(
            b.max_tokens,
            b.tokens_per_fill.map_or(1, |t| t.value),
            fill_interval,
        ))
    }

    pub fn new(max_tokens: u32, tokens_per_fill: u32, fill_interval: Duration) -> TokenBucket {
        TokenBucket {
            max_tokens,
            tokens_per_fill,
            fill_interval,
            state: Mutex::new(State {
                tokens: f64::from(max_tokens),
                refilled: Instant::now(),
            }),
        }
    }

    fn refill(&self, state: &mut State, now: Instant) {
        let elapsed = now.saturating_duration_since(state.refilled).as_secs_f64();
        let rate = f64::from(self.tokens_per_fill) / self.fill_interval.as_secs_f64();
        state.tokens = (state.tokens + elapsed * rate).min(f64::from(self.max_tokens));
        state.refilled = now;
    }

    /// Tokens a second: the descriptors that refill slowest are consumed first.
    pub fn fill_rate(&self) -> f64 {
        f64::from(self.tokens_per_fill) / self.fill_interval.as_secs_f64()
    }

    pub fn fill_interval(&self) -> Duration {
        self.fill_interval
    }

    /// Takes a token if there is one.
    pub fn consume(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut state, Instant::now());
        if state.tokens >= 1.0 {
            state.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// The whole tokens left (`x-ratelimit-remaining`).
    pub fn remaining(&self) -> u32 {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut state, Instant::now());
        state.tokens.floor() as u32
    }

    /// Seconds until the next token (`x-ratelimit-reset`, rounded up): 0 while one is
    /// left, as Envoy's bucket reports.
    pub fn reset_seconds(&self) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.refill(&mut state, Instant::now());
        if state.tokens >= 1.0 {
            return 0;
        }
        let rate = f64::from(self.tokens_per_fill) / self.fill_interval.as_secs_f64();
        ((1.0 - state.tokens) / rate).ceil() as u64
    }
}
