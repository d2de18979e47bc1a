//! The benchmark programs' shared harness (`tests/support/runs.rs`): one way of
//! taking a median for every table they print.

#[path = "support/runs.rs"]
mod runs;

#[test]
fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
    assert_eq!(runs::spread([3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
    assert_eq!(runs::spread([4.0, 1.0, 3.0, 2.0]), (2.5, 1.0, 4.0));
    assert!(runs::spread([]).0.is_nan());
    assert_eq!(runs::cell((2.5, 1.0, 4.0), 1), "2.5 [1.0..4.0]");
}

#[test]
fn configurations_run_interleaved_and_failures_are_left_out() {
    let mut order = Vec::new();
    let results = runs::interleave(
        2,
        &["a", "b", "c"],
        |c| c.to_string(),
        |c| {
            order.push(*c);
            (*c != "b").then_some(c.len())
        },
    );
    assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
    assert_eq!(results, [(0, 1), (2, 1), (0, 1), (2, 1)]);
}
