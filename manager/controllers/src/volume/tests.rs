//! The decision table of [`crate::cases`], on worlds built directly from objects; the same
//! table runs on a store-backed world in `tests/decisions_on_a_store.rs`.

#[test]
fn every_decision_case_holds_on_a_world_built_from_objects() {
    let mut failures = Vec::new();
    let cases = crate::cases::all();
    for case in &cases {
        if let Err(e) = crate::cases::check(case) {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert!(cases.len() >= 30, "{}", cases.len());
}

/// The table can fail: a case whose expectation is off by one action is reported.
#[test]
fn a_wrong_expectation_is_reported() {
    let mut case = crate::cases::all()
        .into_iter()
        .find(|c| c.name == "heal: a replica the engine failed is added back")
        .expect("case");
    case.expect.remove(0);
    let e = crate::cases::check(&case).expect_err("must not match");
    assert!(e.contains("add v-r-2 to the engine (was ERR)"), "{e}");
}
