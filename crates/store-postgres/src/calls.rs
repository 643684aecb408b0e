//! The timing of each model call and tool call of a root turn or a run on
//! PostgreSQL, written with the turn's or run's own commit (one insert in
//! its transaction) and read by the trace views.

use std::collections::HashMap;

use keel_core::{RunId, SessionId, TurnId};
use keel_store::{CallKind, CallSpan, Result, StoreError, MAX_CALL_SPANS};
use tokio_postgres::Row;

use crate::store::Tx;

use crate::store::from_pg;
use crate::util::non_negative;
use crate::PgStore;

/// Whose calls a row holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CallOwner {
    Turn(TurnId),
    Run(RunId),
}

fn kind_str(kind: CallKind) -> &'static str {
    match kind {
        CallKind::Model => "model",
        CallKind::Tool => "tool",
    }
}

fn tokens(what: &str, n: Option<u64>) -> Result<Option<i64>> {
    n.map(|n| {
        i64::try_from(n)
            .map_err(|_| StoreError::InvalidInput(format!("{what} {n} is out of range")))
    })
    .transpose()
}

/// Inserts the first [`MAX_CALL_SPANS`] of `spans` of `owner` in dialog
/// `session`, as one statement, inside the caller's transaction.
pub(crate) async fn insert_calls_tx(
    tx: &Tx<'_>,
    session: &SessionId,
    owner: CallOwner,
    spans: &[CallSpan],
) -> Result<()> {
    let spans = &spans[..spans.len().min(MAX_CALL_SPANS)];
    if spans.is_empty() {
        return Ok(());
    }
    let (turn, run) = match owner {
        CallOwner::Turn(t) => (Some(t.to_string()), None),
        CallOwner::Run(r) => (None, Some(r.to_string())),
    };
    let mut seq = Vec::with_capacity(spans.len());
    let (mut input, mut output) = (Vec::new(), Vec::new());
    for (i, s) in spans.iter().enumerate() {
        if s.ended_at_ms < s.started_at_ms {
            return Err(StoreError::InvalidInput(format!(
                "call span {:?} ends before it starts",
                s.name
            )));
        }
        seq.push(i64::try_from(i).unwrap_or(i64::MAX));
        input.push(tokens("input tokens", s.input_tokens)?);
        output.push(tokens("output tokens", s.output_tokens)?);
    }
    let kind: Vec<&str> = spans.iter().map(|s| kind_str(s.kind)).collect();
    let name: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    let call_id: Vec<Option<&str>> = spans.iter().map(|s| s.call_id.as_deref()).collect();
    let started: Vec<i64> = spans.iter().map(|s| s.started_at_ms).collect();
    let ended: Vec<i64> = spans.iter().map(|s| s.ended_at_ms).collect();
    let status: Vec<&str> = spans.iter().map(|s| s.status.as_str()).collect();
    tx.execute(
        "INSERT INTO call_spans (session_id, turn_id, run_id, seq, kind, name, call_id, \
         started_at, ended_at, input_tokens, output_tokens, status) \
         SELECT $1, $2::text, $3::text, s.* FROM unnest($4::bigint[], $5::text[], $6::text[], \
           $7::text[], $8::bigint[], $9::bigint[], $10::bigint[], $11::bigint[], $12::text[]) \
           AS s",
        &[
            &session.to_string(),
            &turn,
            &run,
            &seq,
            &kind,
            &name,
            &call_id,
            &started,
            &ended,
            &input,
            &output,
            &status,
        ],
    )
    .await
    .map_err(from_pg)?;
    Ok(())
}

const SELECT: &str = "SELECT kind, name, call_id, started_at, ended_at, input_tokens, \
                      output_tokens, status, session_id, run_id FROM call_spans";

fn span_from_row(r: &Row) -> Result<CallSpan> {
    let kind = match r.get::<_, &str>(0) {
        "model" => CallKind::Model,
        "tool" => CallKind::Tool,
        other => return Err(StoreError::corrupt("call_spans.kind", other)),
    };
    let count = |i: usize, what: &str| -> Result<Option<u64>> {
        r.get::<_, Option<i64>>(i)
            .map(|n| non_negative(what, n))
            .transpose()
    };
    Ok(CallSpan {
        kind,
        name: r.get(1),
        call_id: r.get(2),
        started_at_ms: r.get(3),
        ended_at_ms: r.get(4),
        input_tokens: count(5, "call_spans.input_tokens")?,
        output_tokens: count(6, "call_spans.output_tokens")?,
        status: r.get(7),
    })
}

impl PgStore {
    pub(crate) async fn turn_calls(
        &self,
        session: Option<SessionId>,
        turn: TurnId,
    ) -> Result<Vec<CallSpan>> {
        self.read(move |tx| {
            Box::pin(async move {
                let sql = format!("{SELECT} WHERE turn_id = $1 ORDER BY started_at, seq");
                let rows = tx
                    .query(&sql, &[&turn.to_string()])
                    .await
                    .map_err(from_pg)?;
                let owner = session.map(|s| s.to_string());
                rows.iter()
                    .filter(|r| owner.as_deref().is_none_or(|s| r.get::<_, &str>(8) == s))
                    .map(span_from_row)
                    .collect()
            })
        })
        .await
    }

    pub(crate) async fn runs_calls(
        &self,
        runs: Vec<RunId>,
    ) -> Result<HashMap<RunId, Vec<CallSpan>>> {
        let runs: Vec<String> = runs.iter().map(ToString::to_string).collect();
        self.read(move |tx| {
            let runs = runs.clone();
            Box::pin(async move {
                // One read for every run; each run's calls keep their order.
                let sql = format!(
                    "{SELECT} WHERE run_id = ANY($1::text[]) ORDER BY run_id, started_at, seq"
                );
                let rows = tx.query(&sql, &[&runs]).await.map_err(from_pg)?;
                let mut out: HashMap<RunId, Vec<CallSpan>> = HashMap::new();
                for r in &rows {
                    let run = crate::util::parse("call_spans.run_id", r.get::<_, &str>(9))?;
                    out.entry(run).or_default().push(span_from_row(r)?);
                }
                Ok(out)
            })
        })
        .await
    }
}
