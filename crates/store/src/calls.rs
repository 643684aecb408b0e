//! The timing of each model call and tool call of a root turn or a run,
//! written with the turn's or run's own commit (one multi-row insert in
//! its transaction) and read by the trace views.

use std::collections::HashMap;

use keel_core::{RunId, SessionId, TurnId};
use rusqlite::{params_from_iter, types::Value, Connection};

use crate::error::{Result, StoreError};
use crate::util::non_negative;
use crate::SqliteStore;

/// Most call spans one commit stores (the first ones of the turn or run;
/// the rest are dropped and their counts stay on the run).
pub const MAX_CALL_SPANS: usize = 256;

/// What a call span stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// A model (provider) call.
    Model,
    /// A tool call.
    Tool,
}

impl CallKind {
    fn as_str(self) -> &'static str {
        match self {
            Self::Model => "model",
            Self::Tool => "tool",
        }
    }
}

/// One model call or tool call, measured by the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallSpan {
    /// Model or tool.
    pub kind: CallKind,
    /// The model (`profile/model`) or the tool's name.
    pub name: String,
    /// The tool call's id (`None` for a model call).
    pub call_id: Option<String>,
    /// When it started (Unix ms).
    pub started_at_ms: i64,
    /// When it ended (Unix ms, not before `started_at_ms`).
    pub ended_at_ms: i64,
    /// A model call's input tokens.
    pub input_tokens: Option<u64>,
    /// A model call's output tokens.
    pub output_tokens: Option<u64>,
    /// `ok`, `error`, or a model call's finish reason.
    pub status: String,
}

/// The calls of one root turn, committed with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnCalls {
    /// The root turn.
    pub turn_id: TurnId,
    /// Its calls in the order they started (at most [`MAX_CALL_SPANS`] are stored).
    pub spans: Vec<CallSpan>,
}

/// Whose calls a row holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CallOwner {
    Turn(TurnId),
    Run(RunId),
}

const COLUMNS: usize = 12;

fn tokens(what: &str, n: Option<u64>) -> Result<Value> {
    n.map_or(Ok(Value::Null), |n| {
        i64::try_from(n)
            .map(Value::Integer)
            .map_err(|_| StoreError::InvalidInput(format!("{what} {n} is out of range")))
    })
}

/// Inserts the first [`MAX_CALL_SPANS`] of `spans` of `owner` in dialog
/// `session`, as one statement, inside the caller's transaction.
pub(crate) fn insert_calls_tx(
    conn: &Connection,
    session: &SessionId,
    owner: CallOwner,
    spans: &[CallSpan],
) -> Result<()> {
    let spans = &spans[..spans.len().min(MAX_CALL_SPANS)];
    if spans.is_empty() {
        return Ok(());
    }
    let (turn, run) = match owner {
        CallOwner::Turn(t) => (Value::Text(t.to_string()), Value::Null),
        CallOwner::Run(r) => (Value::Null, Value::Text(r.to_string())),
    };
    let mut values: Vec<Value> = Vec::with_capacity(spans.len() * COLUMNS);
    for (seq, s) in spans.iter().enumerate() {
        if s.ended_at_ms < s.started_at_ms {
            return Err(StoreError::InvalidInput(format!(
                "call span {:?} ends before it starts",
                s.name
            )));
        }
        values.extend([
            Value::Text(session.to_string()),
            turn.clone(),
            run.clone(),
            Value::Integer(i64::try_from(seq).unwrap_or(i64::MAX)),
            Value::Text(s.kind.as_str().to_owned()),
            Value::Text(s.name.clone()),
            s.call_id.clone().map_or(Value::Null, Value::Text),
            Value::Integer(s.started_at_ms),
            Value::Integer(s.ended_at_ms),
            tokens("input tokens", s.input_tokens)?,
            tokens("output tokens", s.output_tokens)?,
            Value::Text(s.status.clone()),
        ]);
    }
    let row = format!("({})", ["?"; COLUMNS].join(", "));
    let sql = format!(
        "INSERT INTO call_spans (session_id, turn_id, run_id, seq, kind, name, call_id, \
         started_at, ended_at, input_tokens, output_tokens, status) VALUES {}",
        vec![row; spans.len()].join(", ")
    );
    conn.prepare_cached(&sql)?
        .execute(params_from_iter(values))?;
    Ok(())
}

fn read_calls(conn: &Connection, sql: &str, key: String) -> Result<Vec<(String, CallSpan)>> {
    let mut stmt = conn.prepare_cached(sql)?;
    let mut rows = stmt.query([key])?;
    let mut out = Vec::new();
    while let Some(r) = rows.next()? {
        let kind: String = r.get(0)?;
        let kind = match kind.as_str() {
            "model" => CallKind::Model,
            "tool" => CallKind::Tool,
            other => return Err(StoreError::corrupt("call_spans.kind", other)),
        };
        let count = |i: usize, what: &str| -> Result<Option<u64>> {
            r.get::<_, Option<i64>>(i)?
                .map(|n| non_negative(what, n))
                .transpose()
        };
        out.push((
            r.get(8)?,
            CallSpan {
                kind,
                name: r.get(1)?,
                call_id: r.get(2)?,
                started_at_ms: r.get(3)?,
                ended_at_ms: r.get(4)?,
                input_tokens: count(5, "call_spans.input_tokens")?,
                output_tokens: count(6, "call_spans.output_tokens")?,
                status: r.get(7)?,
            },
        ));
    }
    Ok(out)
}

const SELECT: &str = "SELECT kind, name, call_id, started_at, ended_at, input_tokens, \
                      output_tokens, status, session_id FROM call_spans";

impl SqliteStore {
    pub(crate) async fn turn_calls(
        &self,
        session: Option<SessionId>,
        turn: TurnId,
    ) -> Result<Vec<CallSpan>> {
        self.db
            .read(move |c| {
                let mut calls = read_calls(
                    c,
                    &format!("{SELECT} WHERE turn_id = ?1 ORDER BY started_at, seq"),
                    turn.to_string(),
                )?;
                if let Some(s) = session {
                    calls.retain(|(owner, _)| *owner == s.to_string());
                }
                Ok(calls.into_iter().map(|(_, span)| span).collect())
            })
            .await
    }

    pub(crate) async fn runs_calls(
        &self,
        runs: Vec<RunId>,
    ) -> Result<HashMap<RunId, Vec<CallSpan>>> {
        self.db
            .read(move |c| {
                let sql = format!("{SELECT} WHERE run_id = ?1 ORDER BY started_at, seq");
                let mut out = HashMap::new();
                for run in &runs {
                    let calls = read_calls(c, &sql, run.to_string())?;
                    if !calls.is_empty() {
                        out.insert(*run, calls.into_iter().map(|(_, span)| span).collect());
                    }
                }
                Ok(out)
            })
            .await
    }
}
