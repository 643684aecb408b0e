//! `keel demo` runs offline, end to end, and exits 0.

use std::process::Command;

use keel_core::{ClientVisibility, Delivery, RunId, RunStatus, TurnOrigin};
use keel_store::{EventStatus, EventType, MessageFilter, Store, StoreOptions};

#[test]
fn the_demo_tour_completes_and_recovers_identically() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo", "--data-dir"])
        .arg(dir.path())
        .env("KEEL_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in 1..=8 {
        assert!(
            stdout.contains(&format!("\n{step}. ")),
            "step {step} missing:\n{stdout}"
        );
    }
    assert!(
        stdout.contains("title is now \"Launch checklist\""),
        "{stdout}"
    );
    assert!(
        stdout.contains("identical to before the restart: yes"),
        "{stdout}"
    );
    assert!(stdout.contains("rollback parent"), "{stdout}");
    // The first write waited, was approved and ran; the second was denied
    // and the model read why.
    assert!(stdout.contains("the demo decides: approved"), "{stdout}");
    assert!(
        stdout.contains("the demo decides: denied (keep the notes)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("[the turn resumes] keel> Saved the plan to plan.md."),
        "{stdout}"
    );
    assert!(
        stdout.contains("[the turn resumes] keel> You declined, so I left notes.md as it is."),
        "{stdout}"
    );
    assert!(
        stdout.contains("plan.md exists (18 bytes); notes.md is untouched: yes"),
        "{stdout}"
    );
    // The run tree read back from the database: two foreground runs and the
    // background one, all completed.
    for agent in [
        "researcher  foreground  completed",
        "writer  foreground  completed",
        "archivist  background  completed",
        "monitor  background  completed",
    ] {
        assert!(stdout.contains(agent), "{agent} missing:\n{stdout}");
    }
    // The background result was answered by a continuation while idle.
    assert!(
        stdout.contains("keel> The archivist is done: today's launch decisions are filed"),
        "{stdout}"
    );
    // The monitor's steer signal woke the root's sleep and was read in the
    // same turn; its completion was answered by a second continuation.
    assert!(
        stdout.contains("[sleep ok] woke after")
            && stdout.contains("a signal arrived from sub-agent run"),
        "{stdout}"
    );
    assert!(
        stdout.contains("keel> The monitor warns that the benchmark machine's disk is almost full"),
        "{stdout}"
    );
    assert!(
        stdout.contains("keel> The monitor finished: the benchmark run is watched"),
        "{stdout}"
    );
    assert!(
        stdout.contains(
            "(monitor, warning): \"the benchmark machine's disk is 95% full\" — consumed via steer"
        ),
        "{stdout}"
    );
    // Two completions and the signal, each consumed at the first attempt.
    let inbox: Vec<&str> = stdout.lines().filter(|l| l.contains("inbox: ")).collect();
    assert_eq!(inbox.len(), 3, "{stdout}");
    assert!(
        inbox
            .iter()
            .all(|l| l.ends_with("consumed after 0 failed attempt(s)")),
        "{stdout}"
    );
    assert_eq!(
        inbox
            .iter()
            .filter(|l| l.contains("inbox: signal of run"))
            .count(),
        1,
        "{stdout}"
    );
    assert!(
        dir.path().join("keel.db").exists(),
        "--data-dir keeps the database"
    );
    the_database_shows_the_steer_and_both_continuations(&dir.path().join("keel.db"), &stdout);
}

/// What the tour printed really happened: the database holds the monitor's
/// signal admitted into the user turn (its hidden message right after the
/// sleep result, answered by the very next model call) and two hidden
/// continuation triggers, each answered, with every inbox event consumed.
fn the_database_shows_the_steer_and_both_continuations(db: &std::path::Path, stdout: &str) {
    let monitor: RunId = stdout
        .split("a signal arrived from sub-agent run ")
        .nth(1)
        .and_then(|rest| rest.split(':').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or_else(|| panic!("no monitor run id in:\n{stdout}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = Store::open(db, StoreOptions::default()).unwrap();
        let run = store
            .get_run(monitor)
            .await
            .unwrap()
            .expect("the monitor's run");
        assert_eq!(run.spec.agent_id.as_str(), "monitor");
        assert_eq!(run.status, RunStatus::Completed);
        let session = run.spec.root_session_id;

        let events = store.list_inbox_events(session).await.unwrap();
        assert_eq!(events.len(), 3, "{events:#?}");
        assert!(
            events.iter().all(|e| e.status == EventStatus::Consumed),
            "{events:#?}"
        );
        let signal: Vec<_> = events
            .iter()
            .filter(|e| e.event_type == EventType::Signal)
            .collect();
        assert_eq!(signal.len(), 1, "{events:#?}");
        assert_eq!(signal[0].run_id, Some(monitor));
        assert_eq!(signal[0].delivery, Delivery::Steer);
        assert!(
            signal[0].admitted_turn_id.is_some(),
            "steered into a running turn"
        );

        let history = store
            .load_messages(session, MessageFilter::default())
            .await
            .unwrap();
        let text = |i: usize| history[i].message.text();
        // The steer: sleep's result, the hidden signal, the model's answer to it.
        let sleep = history
            .iter()
            .position(|m| m.message.tool_name.as_deref() == Some("sleep"))
            .expect("the sleep result");
        let steer = &history[sleep + 1].message;
        assert_eq!(steer.visibility, ClientVisibility::Hidden, "{steer:?}");
        assert!(
            text(sleep + 1).starts_with("[Sub-agent news while you work.")
                && text(sleep + 1).contains("95% full"),
            "{}",
            text(sleep + 1)
        );
        assert_eq!(history[sleep + 2].message.origin, TurnOrigin::User);
        assert!(
            text(sleep + 2).starts_with("The monitor warns"),
            "{}",
            text(sleep + 2)
        );
        // The continuations: a hidden trigger naming the run, then the answer.
        let triggers: Vec<usize> = (0..history.len())
            .filter(|&i| text(i).starts_with("[Background results."))
            .collect();
        assert_eq!(triggers.len(), 2, "{history:#?}");
        let answered = [
            (events[0].run_id, "The archivist is done"),
            (Some(monitor), "The monitor finished"),
        ];
        for (&i, (run, answer)) in triggers.iter().zip(answered) {
            let trigger = &history[i].message;
            assert_eq!(trigger.visibility, ClientVisibility::Hidden);
            assert_eq!(trigger.origin, TurnOrigin::AgentContinuation);
            assert!(text(i).contains(&run.unwrap().to_string()), "{}", text(i));
            assert_eq!(history[i + 1].message.origin, TurnOrigin::AgentContinuation);
            assert!(text(i + 1).starts_with(answer), "{}", text(i + 1));
        }
    });
}
