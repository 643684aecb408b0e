//! `current_time` and `sleep`.
//!
//! `sleep` in a root turn ends early when something waits for the turn —
//! the user's steer or next message, a sub-agent's signal, background
//! results — and says which, so the model can react; it consumes nothing
//! (steer is read at the next model call, queued input by the next turn).
//! In a sub-agent run it ends only at its time or when the run is cancelled.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::{
    DelegationPolicy, InputInterruptPolicy, Tool, ToolError, ToolExecutionContext, ToolOutput,
};
use serde::Deserialize;
use serde_json::json;

use super::parse_args;
use crate::mailbox::{TurnMailbox, WakeSource, WakeupState};

/// Longest accepted sleep.
pub(crate) const MAX_SLEEP: Duration = Duration::from_secs(24 * 60 * 60);

/// Formats Unix milliseconds as an RFC 3339 UTC timestamp.
pub(crate) fn rfc3339_utc(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let millis = unix_ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Tells the model the current UTC time.
pub(crate) struct CurrentTimeTool;

#[async_trait]
impl Tool for CurrentTimeTool {
    fn name(&self) -> &str {
        "current_time"
    }
    fn description(&self) -> &str {
        "The current date and time in UTC (RFC 3339) and as Unix milliseconds."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn execute(
        &self,
        _args: serde_json::Value,
        _ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let now = keel_core::time::now_ms();
        Ok(ToolOutput::text(format!(
            "{} (unix_ms {now})",
            rfc3339_utc(now)
        )))
    }
}

/// Waits for a duration; see the module docs for when it ends early.
pub(crate) struct SleepTool;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SleepArgs {
    ms: u64,
}

#[async_trait]
impl Tool for SleepTool {
    fn name(&self) -> &str {
        "sleep"
    }
    fn description(&self) -> &str {
        "Wait for the given number of milliseconds (at most 24 hours). In the main conversation \
         the wait ends early when the user or a background agent has something for you; the \
         result says what."
    }
    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": MAX_SLEEP.as_millis() as u64}},
            "required": ["ms"],
            "additionalProperties": false
        })
    }
    fn delegation_policy(&self) -> DelegationPolicy {
        DelegationPolicy::Delegatable
    }
    fn input_interrupt_policy(&self) -> InputInterruptPolicy {
        InputInterruptPolicy::WakeOnly
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn execute(
        &self,
        args: serde_json::Value,
        ctx: &ToolExecutionContext,
    ) -> Result<ToolOutput, ToolError> {
        let args: SleepArgs = parse_args(args)?;
        let wait = Duration::from_millis(args.ms);
        if wait > MAX_SLEEP {
            return Err(ToolError::InvalidArguments(format!(
                "ms {} is over the 24-hour maximum",
                args.ms
            )));
        }
        let started = tokio::time::Instant::now();
        let deadline = started + wait;
        let Some(mailbox) = ctx.extensions.get::<Arc<TurnMailbox>>() else {
            // A sub-agent's sleep: only its time or its cancellation end it.
            return tokio::select! {
                biased;
                _ = ctx.cancellation.cancelled() => Err(ToolError::Cancelled),
                _ = tokio::time::sleep_until(deadline) => Ok(ToolOutput::text(format!("slept {} ms", args.ms))),
            };
        };
        let mut wakeup = mailbox.wakeup();
        loop {
            // The state is updated after the input is in place, and the
            // receiver remembers a change made between this read and the
            // wait below, so no arrival is missed.
            let state = wakeup.borrow_and_update().clone();
            if state.pending() > 0 {
                let slept = started.elapsed().as_millis();
                return Ok(ToolOutput::text(woke(&state, slept, args.ms)));
            }
            tokio::select! {
                biased;
                _ = ctx.cancellation.cancelled() => return Err(ToolError::Cancelled),
                changed = wakeup.changed() => {
                    if changed.is_err() {
                        // The turn's mailbox is gone: the turn is ending.
                        return Err(ToolError::Cancelled);
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Ok(ToolOutput::text(format!("slept {} ms", args.ms)));
                }
            }
        }
    }
}

/// Why a root turn's sleep ended early; queued input is counted, never shown.
fn woke(state: &WakeupState, slept_ms: u128, asked_ms: u64) -> String {
    let reason = match &state.latest {
        Some(WakeSource::UserSteer) => {
            "the user sent a message for you; you will read it after this tool result".to_owned()
        }
        Some(WakeSource::AgentSteer { run_id, preview }) => format!(
            "a signal arrived from sub-agent run {}: {preview}; its details follow after this tool result",
            run_id.map(|r| r.to_string()).unwrap_or_else(|| "?".into())
        ),
        Some(WakeSource::UserQueue) | None => format!(
            "the user is waiting with {} new message(s) for after this turn; finish your answer",
            state.pending_user_queue
        ),
        Some(WakeSource::AgentQueue) => format!(
            "background results are waiting ({} event(s)); they are delivered after this turn",
            state.pending_agent_queue
        ),
    };
    format!("woke after {slept_ms} of {asked_ms} ms: {reason}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_rfc3339() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_utc(1_795_955_299_000), "2026-11-29T12:28:19.000Z");
    }

    #[tokio::test(start_paused = true)]
    async fn sleep_waits_and_is_cancellable() {
        let ctx = ToolExecutionContext::default();
        let started = tokio::time::Instant::now();
        let out = SleepTool.execute(json!({"ms": 5000}), &ctx).await.unwrap();
        assert_eq!(out.content, "slept 5000 ms");
        assert!(started.elapsed() >= Duration::from_millis(5000));

        let cancelled = ctx.clone();
        let task = tokio::spawn(async move {
            SleepTool
                .execute(json!({"ms": 3_600_000}), &cancelled)
                .await
        });
        tokio::task::yield_now().await;
        ctx.cancellation.cancel();
        assert_eq!(task.await.unwrap().unwrap_err(), ToolError::Cancelled);
        let err = SleepTool
            .execute(json!({"ms": 86_400_001}), &ToolExecutionContext::default())
            .await;
        assert!(matches!(err, Err(ToolError::InvalidArguments(_))));
    }

    fn root_context(mailbox: &Arc<TurnMailbox>) -> ToolExecutionContext {
        let mut ctx = ToolExecutionContext::default();
        ctx.extensions.insert(Arc::clone(mailbox));
        ctx
    }

    #[tokio::test(start_paused = true)]
    async fn a_root_sleep_wakes_for_input_that_arrived_before_or_during_it() {
        use crate::mailbox::MailboxLimits;
        // Before the sleep read its state: it returns at once.
        let mailbox = Arc::new(TurnMailbox::new(
            keel_core::TurnId::new(),
            MailboxLimits::default(),
        ));
        mailbox.push_user(keel_core::Message::user("hi")).unwrap();
        let out = SleepTool
            .execute(json!({"ms": 60_000}), &root_context(&mailbox))
            .await
            .unwrap();
        assert!(
            out.content
                .starts_with("woke after 0 of 60000 ms: the user sent"),
            "{}",
            out.content
        );
        // During it: background results wake it after 10 s, their text unshown.
        let mailbox = Arc::new(TurnMailbox::new(
            keel_core::TurnId::new(),
            MailboxLimits::default(),
        ));
        let ctx = root_context(&mailbox);
        let sleeping =
            tokio::spawn(async move { SleepTool.execute(json!({"ms": 60_000}), &ctx).await });
        tokio::time::sleep(Duration::from_secs(10)).await;
        mailbox.note_queued(WakeSource::AgentQueue);
        let out = sleeping.await.unwrap().unwrap();
        assert_eq!(
            out.content,
            "woke after 10000 of 60000 ms: background results are waiting (1 event(s)); they are delivered after this turn"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_sub_agent_sleep_ignores_the_root_turns_input() {
        // A run's context carries no mailbox: only its time ends the sleep.
        let ctx = ToolExecutionContext {
            run_id: Some(keel_core::RunId::new()),
            ..Default::default()
        };
        let started = tokio::time::Instant::now();
        let out = SleepTool.execute(json!({"ms": 7_000}), &ctx).await.unwrap();
        assert_eq!(out.content, "slept 7000 ms");
        assert_eq!(started.elapsed(), Duration::from_millis(7_000));
    }

    #[tokio::test]
    async fn current_time_is_rfc3339() {
        let out = CurrentTimeTool
            .execute(json!({}), &ToolExecutionContext::default())
            .await
            .unwrap();
        assert!(
            out.content.contains('T') && out.content.contains("Z (unix_ms "),
            "{}",
            out.content
        );
    }
}
