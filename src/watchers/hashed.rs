//! Keys stored with their hash, and lookups by a borrowed key and its hash: the
//! map hashes each key once, with the user's hasher, and never again.

use std::borrow::Borrow;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hash, Hasher};

/// A stored key with its hash, computed once by the map's hasher.
#[derive(Debug)]
pub(super) struct Hashed<K> {
    pub(super) hash: u64,
    pub(super) key: K,
}

/// Hands the stored hash to the table unchanged.
#[derive(Debug, Default)]
pub(super) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn write(&mut self, _: &[u8]) {
        unreachable!("only precomputed hashes are written");
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

impl<K: Clone> Clone for Hashed<K> {
    fn clone(&self) -> Self {
        Hashed {
            hash: self.hash,
            key: self.key.clone(),
        }
    }
}

impl<K> Hash for Hashed<K> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(self.hash);
    }
}

impl<K: Eq> PartialEq for Hashed<K> {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl<K: Eq> Eq for Hashed<K> {}

/// What a lookup compares: a hash and a key, stored (`Hashed`) or borrowed
/// (`Probe`). The table finds lists through `dyn Lookup`, which a stored key
/// lends itself as, so a lookup needs neither an owned key nor a second hash. A
/// probe without a key matches any key with its hash: used only to remove lists
/// already found empty, where taking another empty list of the same hash is as
/// good.
pub(super) trait Lookup<Q: ?Sized> {
    fn hash(&self) -> u64;
    fn key(&self) -> Option<&Q>;
}

impl<K: Borrow<Q>, Q: ?Sized> Lookup<Q> for Hashed<K> {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn key(&self) -> Option<&Q> {
        Some(self.key.borrow())
    }
}

/// A key looked up by reference (or by hash alone), with its hash. Made once
/// per call by [`Watchers::probe`], so a call that looks its key up twice (a
/// walk, then the prune after its checks) hashes it once.
pub(crate) struct Probe<'a, Q: ?Sized> {
    pub(super) hash: u64,
    pub(super) key: Option<&'a Q>,
}

impl<Q: ?Sized> Lookup<Q> for Probe<'_, Q> {
    fn hash(&self) -> u64 {
        self.hash
    }
    fn key(&self) -> Option<&Q> {
        self.key
    }
}

impl<'a, K: Borrow<Q> + 'a, Q: ?Sized + 'a> Borrow<dyn Lookup<Q> + 'a> for Hashed<K> {
    fn borrow(&self) -> &(dyn Lookup<Q> + 'a) {
        self
    }
}

impl<Q: ?Sized> Hash for dyn Lookup<Q> + '_ {
    fn hash<H: Hasher>(&self, h: &mut H) {
        h.write_u64(Lookup::hash(self));
    }
}

impl<Q: ?Sized + Eq> PartialEq for dyn Lookup<Q> + '_ {
    fn eq(&self, other: &Self) -> bool {
        Lookup::hash(self) == Lookup::hash(other)
            && match (self.key(), other.key()) {
                (Some(a), Some(b)) => a == b,
                _ => true,
            }
    }
}

impl<Q: ?Sized + Eq> Eq for dyn Lookup<Q> + '_ {}

/// The hasher keys are hashed with: std's `RandomState` (the default, called
/// directly), or one the user chose, called through a trait object so that the
/// types holding the map do not carry its type.
pub(crate) enum KeyHasher {
    Std(RandomState),
    Chosen(Box<dyn HashWith>),
}

/// A `BuildHasher` seen through a trait object: builds a hasher, lets `feed`
/// write the key into it, and returns the hash.
pub(crate) trait HashWith: Send + Sync {
    fn hash_with(&self, feed: &mut dyn FnMut(&mut dyn Hasher)) -> u64;
}

impl<S: BuildHasher + Send + Sync> HashWith for S {
    fn hash_with(&self, feed: &mut dyn FnMut(&mut dyn Hasher)) -> u64 {
        let mut h = self.build_hasher();
        feed(&mut h);
        h.finish()
    }
}

impl KeyHasher {
    /// The hasher `s`; std's `RandomState` is recognised and called directly.
    pub(crate) fn new<S: BuildHasher + Send + Sync + 'static>(s: S) -> KeyHasher {
        let mut s = Some(s);
        match (&mut s as &mut dyn std::any::Any).downcast_mut::<Option<RandomState>>() {
            Some(std) => KeyHasher::Std(std.take().expect("just made")),
            None => KeyHasher::Chosen(Box::new(s.take().expect("just made"))),
        }
    }

    pub(super) fn hash_one<Q: Hash + ?Sized>(&self, key: &Q) -> u64 {
        match self {
            KeyHasher::Std(s) => s.hash_one(key),
            KeyHasher::Chosen(s) => s.hash_with(&mut |mut h| key.hash(&mut h)),
        }
    }
}

impl Default for KeyHasher {
    fn default() -> Self {
        KeyHasher::Std(RandomState::new())
    }
}

#[cfg(all(test, not(purgatory_loom)))]
mod tests {
    use super::*;

    /// The table is only ever handed precomputed hashes: a key's own `Hash`
    /// never reaches it (that would hash the key a second time, under the lock).
    #[test]
    #[should_panic(expected = "only precomputed hashes")]
    fn the_pass_through_hasher_takes_no_bytes() {
        PassThrough::default().write(b"a key");
    }

    /// Stored keys and probes compare by hash and key; a probe without a key
    /// matches by hash alone (used only to remove lists found empty).
    #[test]
    fn lookups_compare_hash_and_key() {
        let stored = |hash, key: u32| Hashed { hash, key };
        assert!(stored(1, 7) == stored(1, 7));
        assert!(stored(1, 7) != stored(1, 8), "same hash, other key");
        assert!(stored(1, 7) != stored(2, 7), "same key, other hash");
        fn probe(hash: u64, key: Option<&u32>) -> Probe<'_, u32> {
            Probe { hash, key }
        }
        let s = stored(1, 7);
        let s_dyn: &dyn Lookup<u32> = &s;
        assert_eq!(s_dyn.key(), Some(&7));
        assert!(s_dyn == &probe(1, Some(&7)) as &dyn Lookup<u32>);
        assert!(
            s_dyn != &probe(1, Some(&8)) as &dyn Lookup<u32>,
            "a collision is not a match"
        );
        assert!(s_dyn != &probe(2, Some(&7)) as &dyn Lookup<u32>);
        assert!(
            s_dyn == &probe(1, None) as &dyn Lookup<u32>,
            "by hash alone"
        );
        assert!(s_dyn != &probe(2, None) as &dyn Lookup<u32>);
        assert_eq!(probe(3, Some(&9)).key(), Some(&9));
    }
}
