//! The timing of each model call and tool call of a root turn or a run on
//! PostgreSQL, written with the turn's or run's own commit (one insert in
//! its transaction) and read by the trace views.

use std::collections::HashMap;

use keel_core::{RunId, SessionId, TurnId};
use keel_store::{CallKind, CallSpan, Result, StoreError, MAX_CALL_SPANS};
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::store::Tx;

use crate::store::from_pg;
use crate::util::non_negative;
use crate::PgStore;

/// Whose calls a row holds.
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
/// Call spans as the columns [`insert_run_calls_tx`] and a turn's commit
/// insert them from (one array each; at most [`MAX_CALL_SPANS`]).
pub(crate) struct SpanColumns<'a> {
    seq: Vec<i64>,
    kind: Vec<&'static str>,
    name: Vec<&'a str>,
    call_id: Vec<Option<&'a str>>,
    started: Vec<i64>,
    ended: Vec<i64>,
    input: Vec<Option<i64>>,
    output: Vec<Option<i64>>,
    status: Vec<&'a str>,
}

impl<'a> SpanColumns<'a> {
    /// The columns of `spans` (those past [`MAX_CALL_SPANS`] dropped); a
    /// span that ends before it starts is refused.
    pub(crate) fn new(spans: &'a [CallSpan]) -> Result<Self> {
        let spans = &spans[..spans.len().min(MAX_CALL_SPANS)];
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
        Ok(SpanColumns {
            seq,
            kind: spans.iter().map(|s| kind_str(s.kind)).collect(),
            name: spans.iter().map(|s| s.name.as_str()).collect(),
            call_id: spans.iter().map(|s| s.call_id.as_deref()).collect(),
            started: spans.iter().map(|s| s.started_at_ms).collect(),
            ended: spans.iter().map(|s| s.ended_at_ms).collect(),
            input,
            output,
            status: spans.iter().map(|s| s.status.as_str()).collect(),
        })
    }

    /// Whether there is no span to insert.
    pub(crate) fn is_empty(&self) -> bool {
        self.seq.is_empty()
    }

    /// The nine arrays, in the order [`insert_spans_sql!`] reads them.
    pub(crate) fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        [
            &self.seq,
            &self.kind,
            &self.name,
            &self.call_id,
            &self.started,
            &self.ended,
            &self.input,
            &self.output,
            &self.status,
        ]
    }
}

/// Inserts call spans: session `$a`, turn `$b`, run `$c`, their columns
/// the nine arrays from `$d` on ([`SpanColumns::params`]).
macro_rules! insert_spans_sql {
    ($a:literal, $b:literal, $c:literal, $d:literal, $e:literal, $f:literal, $g:literal,
     $h:literal, $i:literal, $j:literal, $k:literal, $l:literal) => {
        concat!(
            "INSERT INTO call_spans (session_id, turn_id, run_id, seq, kind, name, call_id, ",
            "started_at, ended_at, input_tokens, output_tokens, status) ",
            "SELECT ",
            $a,
            ", ",
            $b,
            "::text, ",
            $c,
            "::text, s.* FROM unnest(",
            $d,
            "::bigint[], ",
            $e,
            "::text[], ",
            $f,
            "::text[], ",
            $g,
            "::text[], ",
            $h,
            "::bigint[], ",
            $i,
            "::bigint[], ",
            $j,
            "::bigint[], ",
            $k,
            "::bigint[], ",
            $l,
            "::text[]) AS s"
        )
    };
}
pub(crate) use insert_spans_sql;

/// Inserts the call spans of sub-agent run `run` (a turn's go with its
/// commit).
pub(crate) async fn insert_run_calls_tx(
    tx: &Tx<'_>,
    session: &SessionId,
    run: RunId,
    spans: &[CallSpan],
) -> Result<()> {
    let columns = SpanColumns::new(spans)?;
    if columns.is_empty() {
        return Ok(());
    }
    let (session, run) = (session.to_string(), run.to_string());
    let mut params: Vec<&(dyn ToSql + Sync)> = vec![&session, &run];
    params.extend(columns.params());
    tx.execute(
        insert_spans_sql!(
            "$1", "NULL", "$2", "$3", "$4", "$5", "$6", "$7", "$8", "$9", "$10", "$11"
        ),
        &params,
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
