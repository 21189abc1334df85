package csi_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/weightd/weightd/pkg/csi"
)

// FuzzParseAttributes feeds the parser what a pod author writes: it never
// panics, every refusal wraps ErrBadAttributes, and what it accepts is a
// request with a reference and patterns it can match with.
func FuzzParseAttributes(f *testing.F) {
	f.Add("hf://org/name@main", "pod", "*.safetensors,config.json", "", "")
	f.Add("oci://ghcr.io/org/m:v1", "background", "", "extra", "1")
	f.Add("", "", "[", "", "")
	f.Add("https://h/m.json", "urgent", ",,", "model", "x")
	f.Fuzz(func(t *testing.T, model, priority, files, key, value string) {
		attrs := map[string]string{csi.AttrModel: model, csi.AttrPriority: priority, csi.AttrFiles: files}
		if key != "" {
			attrs[key] = value
		}
		req, err := csi.ParseAttributes(attrs)
		if err != nil {
			if !errors.Is(err, csi.ErrBadAttributes) {
				t.Fatalf("error %v does not wrap ErrBadAttributes", err)
			}
			return
		}
		if req.Ref.String() == "" {
			t.Fatalf("accepted %q without a reference", model)
		}
		if len(req.Files) > csi.MaxFilePatterns {
			t.Fatalf("accepted %d patterns", len(req.Files))
		}
		for _, p := range req.Files {
			if p == "" || strings.TrimSpace(p) != p {
				t.Fatalf("accepted pattern %q", p)
			}
			req.Wants(p)
		}
	})
}

// FuzzParseAllowlist: an operator's allowlist never panics, and what parses
// checks without panicking.
func FuzzParseAllowlist(f *testing.F) {
	f.Add("team-a=hf://org/;oci://ghcr.io/org/,*=hf://public/", "team-a", "hf://org/m@main")
	f.Add("*=*", "x", "y")
	f.Add("=,", "", "")
	f.Fuzz(func(t *testing.T, spec, ns, ref string) {
		a, err := csi.ParseAllowlist(spec)
		if err != nil {
			return
		}
		if err := a.Check(ns, ref); err != nil && !errors.Is(err, csi.ErrNotAllowed) {
			t.Fatalf("Check error %v does not wrap ErrNotAllowed", err)
		}
	})
}
