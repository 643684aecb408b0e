//! `keel chat`: a terminal chat on the engine. Lines are user messages;
//! lines starting with `/` are slash commands. Turns run on the session's
//! worker and everything they stream arrives through the session feed, so
//! a continuation turn that answers background results while the chat is
//! idle is printed too.
//!
//! At a terminal, a line typed while a turn runs steers that turn (the model
//! reads it at its next call) and `/stop` stops it. From a pipe, lines are
//! read one at a time after each turn ends, so a script is deterministic:
//! one line, one message.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use keel_core::{ApprovalId, RunId};
use keel_core::{CheckpointId, Message, SessionId, StreamEvent, TurnId, TurnOrigin};
use keel_engine::DialogAddress;
use keel_engine::TurnEvent;
use keel_engine::{
    EngineError, SessionEvent, SessionManager, SessionSubscription, SignalView, SteerOutcome,
};
use keel_store::{CheckpointRecord, RunRecord};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader, Lines};
use tokio::sync::mpsc;

mod approvals;
mod images;

use crate::app::App;
use crate::error::{io_err, AppError, Result};

/// The channel terminal dialogs live in.
pub const CHANNEL: &str = "cli";

/// One line per slash command, shown by `/help` and after a usage error.
pub const HELP: &str = "\
/new [title]        start a new dialog
/sessions           list this chat's dialogs
/switch <id>        switch to a dialog
/rename <title>     rename the current dialog
/agent [name]       list the agents, or make another one answer this dialog
/image <path>       attach a PNG, JPEG, GIF or WebP to your next message
/delete             delete the current dialog
/compact            summarize the current context
/memory             list the dialog's memory (what the model remembered)
/info               show the current dialog
/stop               stop the running turn and this dialog's background runs
/checkpoints        list checkpoints, newest first
/rollback <ckpt>    go back to a checkpoint (a new branch starts there)
/fork <ckpt>        copy a checkpoint into a new dialog and switch to it
/runs               sub-agent runs of this dialog, as a tree, and their signals
/approvals          tool calls of this dialog waiting for your decision
/approve <id>       let a waiting tool call run (y, n or a answer the last one asked)
/deny <id> [reason] refuse a waiting tool call; the model reads the reason
/help               this list
/exit               leave (Ctrl-D works too)";

/// A parsed slash command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slash {
    /// `/new [title]`.
    New(Option<String>),
    /// `/sessions`.
    Sessions,
    /// `/switch <id>`.
    Switch(String),
    /// `/rename <title>`.
    Rename(String),
    /// `/agent [name]`.
    Agent(Option<String>),
    /// `/image <path>`.
    Image(String),
    /// `/delete`.
    Delete,
    /// `/compact`.
    Compact,
    /// `/memory`.
    Memory,
    /// `/info`.
    Info,
    /// `/stop`.
    Stop,
    /// `/checkpoints`.
    Checkpoints,
    /// `/rollback <ckpt>`.
    Rollback(String),
    /// `/fork <ckpt>`.
    Fork(String),
    /// `/runs`.
    Runs,
    /// `/approvals`.
    Approvals,
    /// `/approve <id>`.
    Approve(String),
    /// `/deny <id> [reason]`.
    Deny(String, Option<String>),
    /// `/help`.
    Help,
    /// `/exit` or `/quit`.
    Exit,
}

/// Parses a line starting with `/`; the error is one line for the user.
pub fn parse_slash(line: &str) -> Result<Slash, String> {
    let line = line.trim();
    let (cmd, rest) = match line.split_once(char::is_whitespace) {
        Some((c, r)) => (c, r.trim()),
        None => (line, ""),
    };
    let arg = || (!rest.is_empty()).then(|| rest.to_owned());
    let no_arg = |s: Slash| {
        if rest.is_empty() {
            Ok(s)
        } else {
            Err(format!("{cmd} takes no argument"))
        }
    };
    let one_word = |name: &str, make: fn(String) -> Slash| match rest.split_whitespace().count() {
        1 => Ok(make(rest.to_owned())),
        0 => Err(format!("{cmd} needs a {name}")),
        _ => Err(format!("{cmd} takes one {name}")),
    };
    match cmd {
        "/new" => Ok(Slash::New(arg())),
        "/sessions" => no_arg(Slash::Sessions),
        "/switch" => one_word("dialog id", Slash::Switch),
        "/rename" => arg()
            .map(Slash::Rename)
            .ok_or_else(|| "/rename needs a title".to_owned()),
        "/agent" => match rest.split_whitespace().count() {
            0 | 1 => Ok(Slash::Agent(arg())),
            _ => Err("/agent takes one agent name".to_owned()),
        },
        "/image" => arg()
            .map(Slash::Image)
            .ok_or_else(|| "/image needs a file path".to_owned()),
        "/delete" => no_arg(Slash::Delete),
        "/compact" => no_arg(Slash::Compact),
        "/memory" => no_arg(Slash::Memory),
        "/info" => no_arg(Slash::Info),
        "/stop" => no_arg(Slash::Stop),
        "/checkpoints" => no_arg(Slash::Checkpoints),
        "/rollback" => one_word("checkpoint id", Slash::Rollback),
        "/fork" => one_word("checkpoint id", Slash::Fork),
        "/runs" => no_arg(Slash::Runs),
        "/approvals" => no_arg(Slash::Approvals),
        "/approve" => one_word("approval id", Slash::Approve),
        "/deny" => match rest.split_once(char::is_whitespace) {
            Some((id, reason)) => Ok(Slash::Deny(id.to_owned(), Some(reason.trim().to_owned()))),
            None if rest.is_empty() => Err("/deny needs an approval id".to_owned()),
            None => Ok(Slash::Deny(rest.to_owned(), None)),
        },
        "/help" => no_arg(Slash::Help),
        "/exit" | "/quit" => no_arg(Slash::Exit),
        other => Err(format!("unknown command {other}")),
    }
}

/// The short form of an id shown to users: its last 8 hex digits (the random
/// part of a UUID v7; the leading digits are a timestamp shared by ids made
/// close together).
pub fn short(id: impl std::fmt::Display) -> String {
    let s = id.to_string();
    let hex: String = s.chars().filter(char::is_ascii_hexdigit).collect();
    hex[hex.len().saturating_sub(8)..].to_owned()
}

struct Chat {
    manager: Arc<SessionManager>,
    chat: String,
    agent: Option<keel_core::AgentId>,
    current: SessionId,
    /// The current dialog's feed.
    feed: SessionSubscription,
    /// Where the stream of the turn being printed stands.
    printer: Printer,
    /// Whether stdin is a terminal (steer and `/stop` while a turn runs).
    interactive: bool,
    out: std::io::Stdout,
    /// The approval last asked inline: `y`, `n` or `a` answers it.
    asking: Option<ApprovalId>,
    /// A root turn's approval was decided since the last turn started: the
    /// next continuation goes on after it, not after background results.
    decided: bool,
    /// Images `/image` stored for the next message.
    images: Vec<keel_core::ContentPart>,
}

/// Line state of the turn output being printed.
struct Printer {
    /// The turn being printed.
    turn: Option<TurnId>,
    /// "keel> " is printed before the first text of each model answer.
    needs_prefix: bool,
    at_line_start: bool,
}

impl Default for Printer {
    fn default() -> Self {
        Self {
            turn: None,
            needs_prefix: true,
            at_line_start: true,
        }
    }
}

/// What a line typed while a turn runs does.
enum WhileRunning {
    /// Keep waiting for the turn.
    Continue,
    /// Stdin ended.
    Eof,
}

/// Runs the chat until EOF or `/exit`.
pub async fn run(
    config: Option<&Path>,
    data_dir: Option<&Path>,
    chat: String,
    agent: Option<String>,
    script: Option<PathBuf>,
) -> Result<ExitCode> {
    let app = App::open("keel chat", config, data_dir, script.as_deref()).await?;
    for notice in &app.notices {
        eprintln!("{notice}");
    }
    let agent = agent
        .map(|a| keel_core::AgentId::parse(&a))
        .transpose()
        .map_err(|e| AppError::InvalidInput(e.to_string()))?;
    DialogAddress::new(CHANNEL, &chat, "default")?;
    let manager = app.manager.clone();
    let current = match manager.latest_dialog(CHANNEL, &chat).await? {
        Some(record) => record.id,
        None => {
            let address = DialogAddress::new(CHANNEL, &chat, "default")?;
            manager.open_dialog(&address, agent.clone()).await?
        }
    };
    let feed = manager.events().subscribe(current).await?;
    let mut chat = Chat {
        manager,
        chat,
        agent,
        current,
        feed,
        printer: Printer::default(),
        interactive: std::io::stdin().is_terminal(),
        out: std::io::stdout(),
        asking: None,
        decided: false,
        images: Vec::new(),
    };
    let mut interrupts = interrupts()?;
    // Listening now: results an earlier process left are delivered.
    // The chat shows every turn of its dialog from the session feed.
    app.deliver_recovered(|_, _| {}).await?;
    // On a shared database this process stays registered while it runs;
    // taken over by another (it could not renew in time), its writes fail
    // and say so.
    let (fenced, _) = tokio::sync::oneshot::channel();
    let _keeper = app.spawn_keeper(|_| {}, fenced);
    let record = chat.manager.record(chat.current).await?;
    chat.say(&format!(
        "keel chat — dialog {} \"{}\" ({} messages). /help lists commands.",
        record.dialog_id, record.title, record.message_count
    ));
    chat.show_unanswered().await?;
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    loop {
        if chat.interactive {
            chat.prompt();
        }
        let line = loop {
            tokio::select! {
                line = lines.next_line() => break line.map_err(io_err("cannot read stdin"))?,
                // A continuation turn may answer background results meanwhile.
                event = chat.feed.recv() => {
                    if chat.show(event).is_some() && chat.interactive {
                        chat.prompt();
                    }
                }
                _ = interrupts.recv() => chat.say("(nothing to stop; /exit or Ctrl-D leaves)"),
            }
        };
        let Some(line) = line else { break };
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        if !chat.interactive {
            chat.say(&format!("> {line}"));
        }
        if let Some(decision) = chat.asking.and_then(|_| approvals::inline_answer(line)) {
            let id = chat.asking.take();
            if let Some(id) = id {
                chat.decide(id, decision, None).await;
            }
            continue;
        }
        if line.starts_with('/') {
            match parse_slash(line) {
                Ok(Slash::Exit) => break,
                Ok(cmd) => {
                    if let Err(e) = chat.command(cmd).await {
                        chat.say(&format!("error: {e}"));
                    }
                }
                Err(e) => {
                    chat.say(&format!("error: {e}"));
                    chat.say(HELP);
                }
            }
        } else if chat.turn(line, &mut lines, &mut interrupts).await? {
            break;
        }
    }
    // A title or summary still being generated is dropped, not waited for.
    chat.manager.shutdown();
    Ok(ExitCode::SUCCESS)
}

/// Ctrl-C presses, from a listener installed once for the whole chat (a
/// press between two turns is never lost or delivered to the wrong place).
fn interrupts() -> Result<mpsc::UnboundedReceiver<()>> {
    let (tx, rx) = mpsc::unbounded_channel();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigint =
            signal(SignalKind::interrupt()).map_err(io_err("cannot listen for Ctrl-C"))?;
        tokio::spawn(async move {
            while sigint.recv().await.is_some() {
                if tx.send(()).is_err() {
                    break;
                }
            }
        });
    }
    #[cfg(not(unix))]
    tokio::spawn(async move {
        while tokio::signal::ctrl_c().await.is_ok() {
            if tx.send(()).is_err() {
                break;
            }
        }
    });
    Ok(rx)
}

impl Chat {
    /// Writes `text` with its control characters made inert: titles, model
    /// answers and tool output may come from anyone.
    fn put(&mut self, text: &str) {
        let _ = self
            .out
            .write_all(crate::terminal::neutralize(text).as_bytes());
    }

    fn say(&mut self, text: &str) {
        self.put(text);
        self.put("\n");
        let _ = self.out.flush();
    }

    fn prompt(&mut self) {
        self.put("you> ");
        let _ = self.out.flush();
    }

    /// Sends `text` as a turn and prints it until it ends; returns true when
    /// stdin ended meanwhile.
    async fn turn<R: AsyncBufRead + Unpin>(
        &mut self,
        text: &str,
        lines: &mut Lines<R>,
        interrupts: &mut mpsc::UnboundedReceiver<()>,
    ) -> Result<bool> {
        let mut input = Message::user(text);
        input.content.append(&mut self.images);
        let ticket = match self.manager.send(self.current, input).await {
            Ok(t) => t,
            Err(e) => {
                self.say(&format!("error: {e}"));
                if let EngineError::AgentRemoved(_) = e {
                    self.say("(/agent lists the agents; /agent NAME switches this dialog to one)");
                }
                return Ok(false);
            }
        };
        let turn_id = ticket.turn_id();
        let mut eof = false;
        loop {
            tokio::select! {
                biased;
                event = self.feed.recv() => {
                    if self.show(event.clone()) == Some(turn_id) {
                        break;
                    }
                    if matches!(event, Err(keel_engine::SubscriptionError::Closed)) {
                        break;
                    }
                }
                Some(()) = interrupts.recv() => self.stop().await,
                line = lines.next_line(), if self.interactive && !eof => {
                    let line = line.map_err(io_err("cannot read stdin"))?;
                    if let WhileRunning::Eof = self.while_running(line).await {
                        eof = true;
                    }
                }
            }
        }
        // How it ended was printed from the feed (`TurnFailed`).
        let _ = ticket.outcome().await;
        Ok(eof)
    }

    /// A line typed while a turn runs: `/stop` stops it, another slash
    /// command waits, anything else steers it.
    async fn while_running(&mut self, line: Option<String>) -> WhileRunning {
        let Some(line) = line else {
            return WhileRunning::Eof;
        };
        let line = line.trim();
        if line.is_empty() {
            return WhileRunning::Continue;
        }
        if line.starts_with('/') {
            match parse_slash(line) {
                Ok(Slash::Stop) => self.stop().await,
                _ => self
                    .say("(a turn is running: /stop stops it; other commands wait until it ends)"),
            }
            return WhileRunning::Continue;
        }
        match self.manager.steer(self.current, line) {
            Ok(SteerOutcome::Steered { .. }) => {
                self.say("(steering: the model reads this at its next step)")
            }
            Ok(SteerOutcome::NoRunningTurn) => {
                self.say("(the turn just ended; send it again as a new message)")
            }
            Err(e) => self.say(&format!("error: {e}")),
        }
        WhileRunning::Continue
    }

    /// `/agent`: lists the agents, the current one marked; `/agent NAME`
    /// makes NAME answer this dialog from its next turn on, history kept.
    async fn agent(&mut self, name: Option<String>) -> Result<()> {
        let m = self.manager.clone();
        let Some(name) = name else {
            let current = m
                .session(self.current)
                .await?
                .lock()
                .await
                .agent()
                .name
                .clone();
            for id in m.agent_ids()? {
                let mark = if id == current { "*" } else { " " };
                self.say(&format!("{mark} {id}"));
            }
            return Ok(());
        };
        let agent = match keel_core::AgentId::parse(&name) {
            Ok(agent) => agent,
            Err(e) => {
                self.say(&format!("error: {e}"));
                return Ok(());
            }
        };
        match m.switch_agent(self.current, &agent).await {
            Ok(()) => self.say(&format!("{agent} answers this dialog from now on")),
            Err(e @ EngineError::UnknownAgent(_)) => {
                self.say(&format!("error: {e} (/agent lists the agents)"))
            }
            Err(e) => return Err(e.into()),
        }
        Ok(())
    }

    async fn stop(&mut self) {
        match self.manager.stop(self.current).await {
            Ok(report) => {
                if report.turn.is_none() {
                    self.say("no turn is running");
                }
                if !report.runs_cancelled.is_empty() {
                    self.say(&format!(
                        "(cancelled {} background run(s))",
                        report.runs_cancelled.len()
                    ));
                }
            }
            Err(e) => self.say(&format!("error: {e}")),
        }
    }

    /// Prints one feed event; returns the turn it ended, if it ended one.
    fn show(
        &mut self,
        event: Result<Arc<SessionEvent>, keel_engine::SubscriptionError>,
    ) -> Option<TurnId> {
        let event = match event {
            Ok(e) => e,
            Err(keel_engine::SubscriptionError::Lagged { skipped }) => {
                self.line_break();
                self.say(&format!(
                    "(the terminal fell behind; {skipped} updates were skipped)"
                ));
                return None;
            }
            Err(keel_engine::SubscriptionError::Closed) => return None,
        };
        match event.as_ref() {
            SessionEvent::TurnStarted { turn_id, origin } => self.start_turn(*turn_id, *origin),
            SessionEvent::Turn {
                turn_id,
                origin,
                event,
            } => {
                // Joined mid-turn (subscribed late, or after a lag).
                if self.printer.turn != Some(*turn_id) {
                    self.start_turn(*turn_id, *origin);
                }
                self.show_turn_event(event)
            }
            SessionEvent::TurnCommitted { turn_id, .. } => {
                self.line_break();
                return Some(*turn_id);
            }
            SessionEvent::TurnFailed {
                turn_id,
                message,
                cancelled,
                timed_out,
                budget_exhausted,
                input_kept,
                ..
            } => {
                self.line_break();
                match (cancelled, input_kept) {
                    (true, true) => self.say("(stopped; your message is kept, marked unanswered)"),
                    (true, false) => self.say("(stopped; nothing from this turn was saved)"),
                    (false, kept) => {
                        let label = if *timed_out {
                            "timed out"
                        } else if *budget_exhausted {
                            "budget exhausted"
                        } else {
                            "error"
                        };
                        self.say(&format!("{label}: {message}"));
                        if *kept {
                            self.say(
                                "(your message is kept, marked unanswered; the next turn sees it)",
                            );
                        }
                    }
                }
                return Some(*turn_id);
            }
            SessionEvent::Notice { text } => {
                self.line_break();
                self.say(&format!("[notice] {text}"));
            }
            SessionEvent::Signal(signal) => {
                self.line_break();
                self.say(&signal_line(signal));
                self.printer.needs_prefix = true;
            }
            SessionEvent::ApprovalRequested(a) => {
                self.line_break();
                let args = one_line(&a.arguments, 80);
                // A background run's call says which run asks.
                let who = a
                    .run_id
                    .map(|run| format!("{} (run {}) asks: ", a.agent_id, short(run)))
                    .unwrap_or_default();
                self.say(&format!(
                    "[approval {}] {who}{}({args}) — allow? [y]es / [n]o / [a]lways",
                    short(a.id),
                    a.tool_name
                ));
                self.asking = Some(a.id);
            }
            SessionEvent::ApprovalDecided(a) => {
                self.line_break();
                let why = a
                    .reason
                    .as_deref()
                    .filter(|_| a.status != keel_store::ApprovalStatus::Approved)
                    .map(|r| format!(" ({r})"))
                    .unwrap_or_default();
                let always = if a.always { " always" } else { "" };
                self.say(&format!(
                    "[approval {}] {} {}{always}{why}",
                    short(a.id),
                    a.tool_name,
                    a.status
                ));
                if self.asking == Some(a.id) {
                    self.asking = None;
                }
                self.decided |= a.run_id.is_none();
            }
            // A title shows in /info and /sessions; it is not announced.
            SessionEvent::RunUpdated { .. }
            | SessionEvent::InboxEventUpdated { .. }
            | SessionEvent::Retitled { .. } => {}
        }
        let _ = self.out.flush();
        None
    }

    fn start_turn(&mut self, turn: TurnId, origin: TurnOrigin) {
        self.line_break();
        self.printer = Printer {
            turn: Some(turn),
            needs_prefix: true,
            at_line_start: true,
        };
        if origin == TurnOrigin::AgentContinuation {
            self.say(if self.decided {
                "[approval decided]"
            } else {
                "[background results arrived]"
            });
        }
        self.decided = false;
    }

    fn show_turn_event(&mut self, event: &TurnEvent) {
        match event {
            TurnEvent::Stream(StreamEvent::TextDelta { text }) => {
                if self.printer.needs_prefix {
                    self.put("keel> ");
                    self.printer.needs_prefix = false;
                }
                self.put(text);
                self.printer.at_line_start = text.ends_with('\n');
            }
            TurnEvent::ToolStarted { call } => {
                self.line_break();
                let args = one_line(&call.arguments.to_string(), 80);
                self.say(&format!("  [tool] {}({args})", call.name));
            }
            TurnEvent::ToolFinished { name, output, .. } => {
                let mark = if output.is_error { "error" } else { "ok" };
                let first = one_line(&output.content, 100);
                self.say(&format!("  [{name} {mark}] {first}"));
                self.printer.needs_prefix = true;
            }
            TurnEvent::SystemNotice { text } => {
                self.line_break();
                self.say(&format!("[notice] {text}"));
            }
            TurnEvent::Stream(_) => {}
        }
    }

    /// Ends a partly printed line.
    fn line_break(&mut self) {
        if !self.printer.at_line_start {
            self.put("\n");
            self.printer.at_line_start = true;
        }
    }

    /// Makes `id` the current dialog and follows its feed.
    async fn switch_to(&mut self, id: SessionId) -> Result<()> {
        self.feed = self.manager.events().subscribe(id).await?;
        self.current = id;
        Ok(())
    }

    /// Lists the current dialog's memory entries, one line each.
    async fn show_memory(&mut self) -> Result<()> {
        let session = self.manager.session(self.current).await?;
        let lines: Vec<String> = session
            .lock()
            .await
            .state()
            .memory
            .iter()
            .map(|(key, entry)| format!("{key}: {}", one_line(&entry.value, 100)))
            .collect();
        if lines.is_empty() {
            self.say("memory is empty");
        }
        for line in lines {
            self.say(&line);
        }
        Ok(())
    }

    /// Lists the current dialog's messages that no turn answered (a turn
    /// that failed, was stopped or was cut off by a crash).
    async fn show_unanswered(&mut self) -> Result<()> {
        let session = self.manager.session(self.current).await?;
        let texts: Vec<String> = session
            .lock()
            .await
            .unanswered()?
            .iter()
            .map(|m| one_line(&m.message.text(), 100))
            .collect();
        for text in texts {
            self.say(&format!("[unanswered] {text}"));
        }
        Ok(())
    }

    /// `/compact`: summarizes the current context now.
    async fn compact(&mut self) {
        match self.manager.compact(self.current).await {
            Ok(true) => {
                self.say("context summarized: the model sees the summary and the messages after it")
            }
            Ok(false) => self.say("nothing new to summarize"),
            Err(e) => self.say(&format!("could not summarize the context: {e}")),
        }
    }

    /// `/info`: the current dialog, its agent, size and usage.
    async fn info(&mut self) -> Result<()> {
        let m = self.manager.clone();
        let session = m.session(self.current).await?;
        let g = session.lock().await;
        let r = g.record();
        let st = g.state();
        let usage = m.store().dialog_usage(self.current).await?;
        let messages = match g.unanswered()?.len() {
            0 => r.message_count.to_string(),
            n => format!("{} ({n} unanswered)", r.message_count),
        };
        let info = format!(
            "dialog {} \"{}\"\nagent {} ({} / {})\nmessages {} · turns {} · slot {} · checkpoints {}\nstored {} bytes\ntokens {} in / {} out over {} model calls",
            r.dialog_id,
            r.title,
            g.agent().name,
            g.agent().provider.name(),
            g.agent().provider.model(),
            messages,
            st.turn_index,
            st.current_slot,
            usage.checkpoints,
            usage.stored_bytes,
            st.cost.prompt_tokens,
            st.cost.completion_tokens,
            st.cost.requests
        );
        drop(g);
        self.say(&info);
        let spend = m.dialog_spend(self.current).await?;
        // The cost shows once something was priced or a budget counts it.
        let cost = match m.dialog_budget() {
            Some(b) => format!(", {} of {b} (session.max_cost_usd_per_dialog)", spend.cost),
            None if spend.cost > keel_core::Usd::ZERO => format!(", {}", spend.cost),
            None => String::new(),
        };
        self.say(&format!(
            "spent {} in / {} out over {} model calls, runs included{cost}",
            spend.usage.prompt_tokens, spend.usage.completion_tokens, spend.model_calls,
        ));
        Ok(())
    }

    async fn command(&mut self, cmd: Slash) -> Result<()> {
        let m = self.manager.clone();
        match cmd {
            Slash::New(title) => {
                let id = m
                    .create_dialog(CHANNEL, &self.chat, title, self.agent.clone())
                    .await?;
                self.switch_to(id).await?;
                let r = m.record(id).await?;
                self.say(&format!("new dialog {} \"{}\"", r.dialog_id, r.title));
            }
            Slash::Sessions => {
                let page = m.list_dialogs(CHANNEL, &self.chat, 10, None).await?;
                for r in page.items {
                    let mark = if r.id == self.current { "*" } else { " " };
                    self.say(&format!(
                        "{mark} {}  \"{}\"  {} messages",
                        r.dialog_id, r.title, r.message_count
                    ));
                }
            }
            Slash::Switch(dialog) => {
                let address = DialogAddress::new(CHANNEL, &self.chat, &dialog)?;
                let found = m
                    .store()
                    .get_dialog(CHANNEL, &self.chat, &dialog)
                    .await?
                    .filter(|r| r.deleted_at_ms.is_none());
                match found {
                    Some(r) => {
                        self.switch_to(r.id).await?;
                        self.say(&format!(
                            "switched to {} \"{}\"",
                            address.dialog_id(),
                            r.title
                        ));
                        self.show_unanswered().await?;
                    }
                    None => self.say(&format!("error: no dialog {dialog} (see /sessions)")),
                }
            }
            Slash::Rename(title) => {
                m.rename_dialog(self.current, &title).await?;
                let r = m.record(self.current).await?;
                self.say(&format!("renamed to \"{}\"", r.title));
            }
            Slash::Agent(name) => self.agent(name).await?,
            Slash::Delete => {
                let r = m.record(self.current).await?;
                m.delete_dialog(self.current).await?;
                self.say(&format!("deleted {} \"{}\"", r.dialog_id, r.title));
                let next = match m.latest_dialog(CHANNEL, &self.chat).await? {
                    Some(next) => next.id,
                    None => {
                        m.create_dialog(CHANNEL, &self.chat, None, self.agent.clone())
                            .await?
                    }
                };
                self.switch_to(next).await?;
                let r = m.record(self.current).await?;
                self.say(&format!("now in {} \"{}\"", r.dialog_id, r.title));
            }
            Slash::Memory => self.show_memory().await?,
            Slash::Image(path) => self.attach_image(&path).await,
            Slash::Compact => self.compact().await,
            Slash::Info => self.info().await?,
            Slash::Stop => self.stop().await,
            Slash::Checkpoints => {
                let list = m.list_checkpoints(self.current).await?;
                if list.is_empty() {
                    self.say("no checkpoints yet");
                }
                for c in list {
                    self.say(&checkpoint_line(&c));
                }
            }
            Slash::Rollback(id) => {
                let target = self.resolve_checkpoint(&id).await?;
                m.rollback(self.current, target).await?;
                let turns = m.session(self.current).await?.lock().await.turn_index();
                self.say(&format!(
                    "rolled back to {} (turn {turns}); new turns start a new branch",
                    short(target)
                ));
            }
            Slash::Fork(id) => {
                let target = self.resolve_checkpoint(&id).await?;
                let new = m.fork(target, None).await?;
                self.switch_to(new).await?;
                let r = m.record(new).await?;
                self.say(&format!(
                    "forked {} into dialog {} \"{}\"",
                    short(target),
                    r.dialog_id,
                    r.title
                ));
            }
            c @ (Slash::Approvals | Slash::Approve(_) | Slash::Deny(..)) => {
                self.approval_command(c).await?
            }
            Slash::Runs => {
                let page = m.store().list_runs(self.current, None, 50).await?;
                if page.items.is_empty() {
                    self.say("no sub-agent runs in this dialog");
                }
                for line in run_tree(&page.items) {
                    self.say(&line);
                }
                let signals = m.signals(self.current, 20).await?;
                if !signals.is_empty() {
                    self.say("signals (newest first):");
                }
                for s in &signals {
                    self.say(&format!("  {} ({})", signal_line(s), s.status));
                }
            }
            Slash::Help => self.say(HELP),
            Slash::Exit => {}
        }
        Ok(())
    }

    async fn resolve_checkpoint(&self, text: &str) -> Result<CheckpointId> {
        let list = self.manager.list_checkpoints(self.current).await?;
        let ids: Vec<CheckpointId> = list.iter().map(|c| c.id).collect();
        pick_checkpoint(text, &ids).map_err(AppError::InvalidInput)
    }
}

/// The checkpoint whose id ends with the hex digits of `text` (dashes
/// ignored, as in the short ids `/checkpoints` shows). No digits, no match
/// or several matches is an error naming the candidates, never a guess.
pub fn pick_checkpoint(text: &str, ids: &[CheckpointId]) -> Result<CheckpointId, String> {
    let wanted = text.to_ascii_lowercase().replace('-', "");
    let candidates = |ids: &[&CheckpointId]| {
        let mut shown: Vec<String> = ids.iter().take(10).map(short).collect();
        if ids.len() > 10 {
            shown.push(format!("… {} more", ids.len() - 10));
        }
        shown.join(", ")
    };
    if wanted.is_empty() || !wanted.chars().all(|c| c.is_ascii_hexdigit()) {
        let all: Vec<&CheckpointId> = ids.iter().collect();
        return Err(if all.is_empty() {
            format!("{text:?} is not a checkpoint id, and this dialog has no checkpoints yet")
        } else {
            format!(
                "{text:?} is not a checkpoint id; give the hex digits of one of: {}",
                candidates(&all)
            )
        });
    }
    let matches: Vec<&CheckpointId> = ids
        .iter()
        .filter(|id| id.to_string().replace('-', "").ends_with(&wanted))
        .collect();
    match matches.as_slice() {
        [one] => Ok(**one),
        [] => Err(format!(
            "no checkpoint {text} in this dialog (see /checkpoints)"
        )),
        several => Err(format!(
            "{text} matches {} checkpoints: {}; give more digits",
            several.len(),
            candidates(several)
        )),
    }
}

/// Runs as an indented tree (children under their parent, oldest first),
/// one line each: id, agent, mode, status, duration, tokens.
pub fn run_tree(runs: &[RunRecord]) -> Vec<String> {
    fn walk(runs: &[RunRecord], parent: Option<RunId>, depth: usize, out: &mut Vec<String>) {
        let mut children: Vec<&RunRecord> = runs
            .iter()
            .filter(|r| r.spec.parent_run_id == parent)
            .collect();
        children.sort_by_key(|r| (r.created_at_ms, r.spec.id));
        for r in children {
            let duration = match (r.started_at_ms, r.finished_at_ms) {
                (Some(s), Some(f)) => format!("{} ms", (f - s).max(0)),
                (Some(_), None) => "running".to_owned(),
                _ => "-".to_owned(),
            };
            let tokens = r
                .usage
                .map(|u| u.total().to_string())
                .unwrap_or_else(|| "-".into());
            out.push(format!(
                "{}{}  {}  {}  {}  {}  {} tokens",
                "  ".repeat(depth),
                short(r.spec.id),
                r.spec.agent_id,
                r.spec.mode,
                r.status,
                duration,
                tokens
            ));
            walk(runs, Some(r.spec.id), depth + 1, out);
        }
    }
    let mut out = Vec::new();
    walk(runs, None, 0, &mut out);
    out
}

/// One line about a sub-agent's signal.
fn signal_line(s: &SignalView) -> String {
    format!(
        "[signal {}] {} (run {}): {}",
        s.severity,
        s.agent_id,
        s.run_id.map(short).unwrap_or_else(|| "?".into()),
        one_line(&s.summary, 200)
    )
}

fn checkpoint_line(c: &CheckpointRecord) -> String {
    let parent = c.parent_id.map(short).unwrap_or_else(|| "-".into());
    format!(
        "{}  turn {:>3}  {:<8}  parent {}",
        short(c.id),
        c.turn_index,
        c.source.as_str(),
        parent
    )
}

fn one_line(s: &str, max: usize) -> String {
    let flat: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        let mut cut: String = flat.chars().take(max).collect();
        cut.push('…');
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_command_and_rejects_bad_input() {
        assert_eq!(parse_slash("/new"), Ok(Slash::New(None)));
        assert_eq!(
            parse_slash("/new  My plan "),
            Ok(Slash::New(Some("My plan".into())))
        );
        assert_eq!(
            parse_slash("/switch ab12"),
            Ok(Slash::Switch("ab12".into()))
        );
        assert_eq!(parse_slash("/rename A B"), Ok(Slash::Rename("A B".into())));
        assert_eq!(parse_slash("/agent"), Ok(Slash::Agent(None)));
        assert_eq!(
            parse_slash("/image ./my cat.png"),
            Ok(Slash::Image("./my cat.png".into()))
        );
        assert!(parse_slash("/image").is_err());
        assert_eq!(
            parse_slash("/agent writer"),
            Ok(Slash::Agent(Some("writer".into())))
        );
        assert!(parse_slash("/agent a b").is_err());
        assert_eq!(
            parse_slash("/rollback 1234abcd"),
            Ok(Slash::Rollback("1234abcd".into()))
        );
        assert_eq!(parse_slash("/quit"), Ok(Slash::Exit));
        let errors: Vec<String> = [
            "/frobnicate",
            "/switch",
            "/switch a b",
            "/rename",
            "/info now",
            "/fork",
        ]
        .iter()
        .map(|l| parse_slash(l).unwrap_err())
        .collect();
        insta::assert_yaml_snapshot!(errors, @r"
        - unknown command /frobnicate
        - /switch needs a dialog id
        - /switch takes one dialog id
        - /rename needs a title
        - /info takes no argument
        - /fork needs a checkpoint id
        ");
    }

    #[test]
    fn a_checkpoint_is_picked_only_by_a_unique_suffix_of_hex_digits() {
        let ids: Vec<CheckpointId> = [
            "0190f3a2-7b1c-7def-8abc-0123456789ab",
            "0190f3a2-7b1c-7def-8abc-0123456700ab",
            "0190f3a2-7b1c-7def-8abc-0123456789cd",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(pick_checkpoint("456789AB", &ids), Ok(ids[0]));
        assert_eq!(pick_checkpoint("0123-456789cd", &ids), Ok(ids[2]));
        let errors: Vec<String> = ["-", " ", "ab", "zz", "ef"]
            .iter()
            .map(|t| pick_checkpoint(t, &ids).unwrap_err())
            .chain([pick_checkpoint("-", &[]).unwrap_err()])
            .collect();
        insta::assert_yaml_snapshot!(errors, @r#"
        - "\"-\" is not a checkpoint id; give the hex digits of one of: 456789ab, 456700ab, 456789cd"
        - "\" \" is not a checkpoint id; give the hex digits of one of: 456789ab, 456700ab, 456789cd"
        - "ab matches 2 checkpoints: 456789ab, 456700ab; give more digits"
        - "\"zz\" is not a checkpoint id; give the hex digits of one of: 456789ab, 456700ab, 456789cd"
        - no checkpoint ef in this dialog (see /checkpoints)
        - "\"-\" is not a checkpoint id, and this dialog has no checkpoints yet"
        "#);
    }

    #[test]
    fn short_ids_use_the_random_tail() {
        let id = "0190f3a2-7b1c-7def-8abc-0123456789ab";
        assert_eq!(short(id), "456789ab");
        assert_eq!(one_line("a\n b   c", 10), "a b c");
        assert_eq!(one_line("abcdef", 3), "abc…");
    }
}
