// Package adversary holds one test per attack of issue 21: each failed against the main the issue started from, and guards the fix.
package adversary
