//! The slab and watch lists of the one-lock peers the benchmarks measure this
//! crate against (`benches/churn.rs`, `examples/purgatory_perf`): a request's
//! generation-checked id, taking a slot, and watching a request's keys.
//! Included with `#[path]`.

use std::collections::HashMap;

/// A request's id: its slot, and the slot's generation when it was taken.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Id {
    pub index: u32,
    pub generation: u32,
}

/// A free slot (or a new one at the end), named with its generation.
pub fn vacant<S: Default>(
    slots: &mut Vec<S>,
    free: &mut Vec<u32>,
    generation: impl Fn(&S) -> u32,
) -> Id {
    let index = free.pop().unwrap_or_else(|| {
        slots.push(S::default());
        slots.len() as u32 - 1
    });
    Id {
        index,
        generation: generation(&slots[index as usize]),
    }
}

/// Puts `id` on the list of each of `keys` once (a key given twice is
/// watched once); returns how many lists it went on.
pub fn watch(watchers: &mut HashMap<u32, Vec<Id>>, keys: &[u32], id: Id) -> u32 {
    let mut n = 0;
    for (i, k) in keys.iter().enumerate() {
        if !keys[..i].contains(k) {
            watchers.entry(*k).or_default().push(id);
            n += 1;
        }
    }
    n
}
