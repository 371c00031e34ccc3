//! A stream's timers, as Envoy's connection manager runs them: `stream_idle_timeout`
//! (no byte either way), `request_timeout` (the whole request, until the response
//! starts) and `max_stream_duration`. One that fires before the response headers are
//! sent is answered 408 while the request is still arriving, 504 once it is all in (as
//! Envoy 1.40 answers); after, the stream is reset (the response body fails: HTTP/1
//! closes the connection, HTTP/2 resets the stream).

use tokio::time::Instant;

use super::body::LogSlot;
use super::config::{HttpStats, StreamTimeouts};
use shunt_core::access_log::ResponseFlag;

/// Which timer ended a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timeout {
    Idle,
    Request,
    MaxDuration,
}

impl Timeout {
    /// Envoy's local reply body.
    pub fn body(self) -> &'static str {
        match self {
            Timeout::Idle => "stream timeout",
            Timeout::Request => "request timeout",
            Timeout::MaxDuration => "downstream duration timeout",
        }
    }

    pub fn flag(self) -> Option<ResponseFlag> {
        (self == Timeout::Idle).then_some(ResponseFlag::StreamIdleTimeout)
    }

    fn count(self, stats: &HttpStats) {
        match self {
            Timeout::Idle => stats.downstream_rq_idle_timeout.inc(),
            Timeout::Request => stats.downstream_rq_timeout.inc(),
            Timeout::MaxDuration => stats.downstream_rq_max_duration_reached.inc(),
        }
    }
}

/// Resolves when one of the stream's timers fires, having counted it and noted it in
/// `log`. `response_started`: the request timer no longer runs.
pub async fn watch(
    timeouts: StreamTimeouts,
    stats: &HttpStats,
    log: &LogSlot,
    response_started: bool,
) -> Timeout {
    let mut woke = false;
    loop {
        // Registered before the deadlines are read, so a route setting its own
        // `max_stream_duration` in between is not missed.
        let rescheduled = log.rescheduled();
        tokio::pin!(rescheduled);
        rescheduled.as_mut().enable();
        let mut next: Option<(Instant, Timeout)> = None;
        let mut consider = |at: Instant, why: Timeout| {
            if next.is_none_or(|(n, _)| at < n) {
                next = Some((at, why));
            }
        };
        if let Some(max) = log.max_duration(timeouts.max_duration) {
            consider(log.started() + max, Timeout::MaxDuration);
        }
        if let Some(request) = timeouts.request
            && !response_started
            && !log.request_complete()
        {
            consider(log.started() + request, Timeout::Request);
        }
        if let Some(idle) = timeouts.idle {
            consider(log.last_activity() + idle, Timeout::Idle);
        }
        let Some((at, why)) = next else {
            rescheduled.await;
            continue;
        };
        // Read the clock only once a timer woke: a deadline already past fires at the
        // first poll of its sleep anyway, and most streams end long before theirs.
        if woke && at <= Instant::now() {
            tracing::debug!(?why, response_started, "stream timeout");
            why.count(stats);
            log.ended_by(why);
            return why;
        }
        // Activity (or the request's end) moves the deadlines: check again then, or
        // at once when the route changed them.
        woke = tokio::select! {
            () = tokio::time::sleep_until(at) => true,
            () = rescheduled => false,
        };
    }
}
