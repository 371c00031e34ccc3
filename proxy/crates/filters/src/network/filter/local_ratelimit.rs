//! Envoy's network local rate limit filter (`envoy.filters.network.local_ratelimit`):
//! each new connection takes a token from the filter's bucket, and one that finds it
//! empty is closed before the terminal filter sees it. `runtime_enabled` (default on)
//! turns it off. Stats, as Envoy names them: `local_rate_limit.<stat_prefix>.rate_limited`.

use std::sync::Arc;

use envoy_types::pb::envoy::extensions::filters::network::local_ratelimit::v3::LocalRateLimit;
use envoy_types::pb::google::protobuf::Any;

use crate::common::token_bucket::TokenBucket;
use crate::network::factory::{CompileCtx, Factory};
use crate::network::{
    NetworkFilter, NetworkFilterConfig, NetworkFlow, NetworkStatus, NewConnection,
};
use shunt_config::convert::decode;
use shunt_config::{Diagnostics, JsonPath};
use shunt_core::stats::Counter;

pub const TYPE: &str = "envoy.extensions.filters.network.local_ratelimit.v3.LocalRateLimit";

pub const FACTORY: Factory = Factory {
    type_name: TYPE,
    compile,
};

#[derive(Debug)]
struct Config {
    bucket: TokenBucket,
    enabled: bool,
    rate_limited: Counter,
}

#[derive(Debug)]
struct LocalRateLimitFilter(Arc<Config>);

fn compile(
    any: &Any,
    ctx: &CompileCtx<'_>,
    path: &JsonPath,
    problems: &mut Diagnostics,
) -> Option<Arc<dyn NetworkFilterConfig>> {
    let config = decode::<LocalRateLimit>(any, path, problems)?;
    if config.stat_prefix.is_empty() {
        problems.error(path.field("stat_prefix"), "is required");
        return None;
    }
    let Some(bucket) = &config.token_bucket else {
        problems.error(path.field("token_bucket"), "is required");
        return None;
    };
    if !config.share_key.is_empty() {
        problems.warning(
            path.field("share_key"),
            "shared buckets are not implemented; this filter has its own",
        );
    }
    let bucket = TokenBucket::compile(bucket, &path.field("token_bucket"), problems)?;
    let enabled = config
        .runtime_enabled
        .as_ref()
        .and_then(|f| f.default_value.as_ref())
        .is_none_or(|v| v.value);
    let rate_limited = ctx.stats.counter(&format!(
        "local_rate_limit.{}.rate_limited",
        config.stat_prefix
    ));
    Some(Arc::new(LocalRateLimitFilter(Arc::new(Config {
        bucket,
        enabled,
        rate_limited,
    }))))
}

impl NetworkFilterConfig for LocalRateLimitFilter {
    fn create(&self) -> Box<dyn NetworkFilter> {
        Box::new(LocalRateLimitConnection(self.0.clone()))
    }
}

struct LocalRateLimitConnection(Arc<Config>);

impl NetworkFilter for LocalRateLimitConnection {
    fn on_new_connection<'a>(&'a mut self, ctx: &'a mut NewConnection<'_>) -> NetworkFlow<'a> {
        let config = &self.0;
        if !config.enabled || config.bucket.consume() {
            return NetworkFlow::CONTINUE;
        }
        config.rate_limited.inc();
        tracing::debug!(remote = %ctx.connection.remote, "local rate limit: closing the connection");
        // Envoy closes before reading what the client sent: the kernel resets.
        ctx.reset_on_close();
        NetworkFlow::Ready(NetworkStatus::Close)
    }
}
