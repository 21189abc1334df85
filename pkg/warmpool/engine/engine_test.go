package engine_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/weightd/weightd/internal/loratest"
	"github.com/weightd/weightd/pkg/lora"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// flavour is one runtime server configuration the drivers are tested
// against.
type flavour struct {
	name  string
	kind  engine.Kind
	start func(loratest.Options) (*loratest.Server, error)
	opts  loratest.Options
}

func flavours() []flavour {
	return []flavour{
		{"vllm-flat", engine.VLLM, loratest.NewVLLM, loratest.Options{}},
		{"vllm-nested", engine.VLLM, loratest.NewVLLM, loratest.Options{NestedErrors: true}},
		{"sglang", engine.SGLang, loratest.NewSGLang, loratest.Options{}},
		{"sglang-older", engine.SGLang, loratest.NewSGLang, loratest.Options{OlderSGLang: true}},
	}
}

// setup starts the flavour's server with opts layered on and returns it
// with a driver.
func setup(t *testing.T, f flavour, edit func(*loratest.Options), client *http.Client) (*loratest.Server, engine.Driver) {
	t.Helper()
	opts := f.opts
	if edit != nil {
		edit(&opts)
	}
	srv, err := f.start(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	d, err := engine.New(f.kind, srv.URL(), client)
	if err != nil {
		t.Fatal(err)
	}
	if d.Kind() != f.kind {
		t.Fatalf("kind %s, want %s", d.Kind(), f.kind)
	}
	return srv, d
}

func adapter(t *testing.T, s loratest.AdapterSpec) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "adapter")
	if err := loratest.WriteAdapter(dir, s); err != nil {
		t.Fatal(err)
	}
	return dir
}

func names(t *testing.T, d engine.Driver) map[string]engine.Adapter {
	t.Helper()
	as, err := d.Adapters(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]engine.Adapter{}
	for _, a := range as {
		m[a.Name] = a
	}
	return m
}

func wantErr(t *testing.T, err, sentinel error) {
	t.Helper()
	if !errors.Is(err, sentinel) {
		t.Fatalf("got %v, want %v", err, sentinel)
	}
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			srv, d := setup(t, f, nil, nil)
			ctx := context.Background()
			path := adapter(t, loratest.AdapterSpec{Base: "base"})
			if err := d.Health(ctx); err != nil {
				t.Fatal(err)
			}
			if got := names(t, d); len(got) != 0 {
				t.Fatalf("adapters before any load: %v", got)
			}
			if err := d.Load(ctx, "a", path, true); err != nil {
				t.Fatal(err)
			}
			got := names(t, d)
			parent := "base"
			if f.opts.OlderSGLang {
				// Known from the load answer, which does not name the base.
				parent = ""
			}
			if a := got["a"]; len(got) != 1 || a.Path != path || a.Parent != parent {
				t.Fatalf("adapters %+v", got)
			}
			wantErr(t, d.Load(ctx, "a", path, false), engine.ErrAlreadyLoaded)
			if err := d.Unload(ctx, "a"); err != nil {
				t.Fatal(err)
			}
			wantErr(t, d.Unload(ctx, "a"), engine.ErrNotLoaded)
			if got := names(t, d); len(got) != 0 {
				t.Fatalf("adapters after unload: %v", got)
			}
			if srv.Loads("a") != 1 || srv.Unloads("a") != 1 {
				t.Fatalf("loads %d unloads %d", srv.Loads("a"), srv.Unloads("a"))
			}
		})
	}
}

func TestRejections(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()

			_, off := setup(t, f, func(o *loratest.Options) { o.Disabled = true }, nil)
			wantErr(t, off.Load(ctx, "a", adapter(t, loratest.AdapterSpec{}), false), engine.ErrUnsupported)
			wantErr(t, off.Unload(ctx, "a"), engine.ErrUnsupported)

			_, d := setup(t, f, func(o *loratest.Options) { o.MaxRank = 16; o.Slots = 1 }, nil)
			wantErr(t, d.Load(ctx, "big", adapter(t, loratest.AdapterSpec{Rank: 32}), false), engine.ErrRejected)
			wantErr(t, d.Load(ctx, "missing", filepath.Join(t.TempDir(), "nothing"), false), engine.ErrRejected)

			corrupt := adapter(t, loratest.AdapterSpec{})
			if err := os.WriteFile(filepath.Join(corrupt, lora.WeightsFile), []byte("garbage!garbage!"), 0o644); err != nil {
				t.Fatal(err)
			}
			wantErr(t, d.Load(ctx, "corrupt", corrupt, false), engine.ErrRejected)

			if err := d.Load(ctx, "one", adapter(t, loratest.AdapterSpec{Rank: 16}), false); err != nil {
				t.Fatal(err)
			}
			// Past --max-loras vLLM loads and lists; SGLang refuses past
			// --max-loaded-loras.
			err := d.Load(ctx, "two", adapter(t, loratest.AdapterSpec{}), false)
			want := 1
			if f.kind == engine.VLLM {
				want = 2
				if err != nil {
					t.Fatal(err)
				}
			} else {
				wantErr(t, err, engine.ErrRejected)
			}
			if got := names(t, d); len(got) != want {
				t.Fatalf("adapters %v, want %d", got, want)
			}
		})
	}
}

func TestBaseMismatch(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		_, d := setup(t, f, func(o *loratest.Options) { o.Base = "org/base"; o.CheckBase = true }, nil)
		wantErr(t, d.Load(context.Background(), "a", adapter(t, loratest.AdapterSpec{Base: "org/other"}), false), engine.ErrRejected)
		if err := d.Load(context.Background(), "b", adapter(t, loratest.AdapterSpec{Base: "org/base"}), false); err != nil {
			t.Fatalf("%s: %v", f.name, err)
		}
	}
}

func TestFaults(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			srv, d := setup(t, f, nil, nil)
			// A driver whose client gives up soon, for the hang; nothing is
			// asserted about time.
			impatient, err := engine.New(f.kind, srv.URL(), &http.Client{Timeout: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			path := adapter(t, loratest.AdapterSpec{})

			srv.FailNext(2)
			wantErr(t, d.Load(ctx, "a", path, false), engine.ErrUnavailable)
			wantErr(t, d.Health(ctx), engine.ErrUnavailable)
			if err := d.Health(ctx); err != nil {
				t.Fatal(err)
			}

			srv.SetHang(true)
			wantErr(t, impatient.Load(ctx, "a", path, false), engine.ErrUnavailable)
			srv.SetHang(false)

			srv.SetLie(true)
			err = d.Load(ctx, "liar", path, false)
			if f.kind == engine.SGLang {
				// Its answer's loaded_adapters gives it away.
				wantErr(t, err, engine.ErrUnavailable)
			} else if err != nil {
				t.Fatalf("a lying server: %v", err)
			}
			if _, ok := names(t, d)["liar"]; ok {
				t.Fatal("a lying server lists the adapter")
			}
			srv.SetLie(false)

			if err := d.Load(ctx, "kept", path, false); err != nil {
				t.Fatal(err)
			}
			srv.KillOnNextLoad()
			wantErr(t, d.Load(ctx, "b", path, false), engine.ErrUnavailable)
			wantErr(t, d.Health(ctx), engine.ErrUnavailable)
			if err := srv.Restart(); err != nil {
				t.Fatal(err)
			}
			if err := d.Health(ctx); err != nil {
				t.Fatal(err)
			}
			if got := names(t, d); len(got) != 0 {
				t.Fatalf("adapters after a restart: %v", got)
			}
		})
	}
}

func TestCanceledContext(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		srv, d := setup(t, f, nil, nil)
		srv.SetDelay(time.Hour)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		wantErr(t, d.Load(ctx, "a", adapter(t, loratest.AdapterSpec{}), false), engine.ErrUnavailable)
	}
}

// Concurrent loads on a server with two slots: SGLang (--max-loaded-loras
// 2) takes two and rejects the rest, never holding more than two; vLLM
// (--max-loras 2) takes and lists them all.
func TestConcurrentLoadsPastSlots(t *testing.T) {
	t.Parallel()
	for _, f := range flavours() {
		srv, d := setup(t, f, func(o *loratest.Options) { o.Slots = 2 }, nil)
		path := adapter(t, loratest.AdapterSpec{})
		var wg sync.WaitGroup
		errs := make([]error, 8)
		for i := range errs {
			wg.Go(func() { errs[i] = d.Load(context.Background(), string(rune('a'+i)), path, false) })
		}
		wg.Wait()
		ok := 0
		for _, err := range errs {
			switch {
			case err == nil:
				ok++
			case !errors.Is(err, engine.ErrRejected):
				t.Fatalf("%s: %v", f.name, err)
			}
		}
		want := 2
		if f.kind == engine.VLLM {
			want = len(errs)
		}
		if ok != want || srv.Peak() != want || len(srv.Loaded()) != want || len(names(t, d)) != want {
			t.Fatalf("%s: %d loads succeeded, peak %d, want %d", f.name, ok, srv.Peak(), want)
		}
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		kind     engine.Kind
		endpoint string
	}{
		{"triton", "http://127.0.0.1:1"},
		{engine.VLLM, "127.0.0.1:8000"},
		{engine.VLLM, "ftp://host"},
		{engine.SGLang, "http://"},
		{engine.SGLang, "http://host/?q=1"},
		{engine.SGLang, "http://user:pw@host"},
	} {
		if _, err := engine.New(tc.kind, tc.endpoint, nil); err == nil {
			t.Errorf("New(%q, %q) succeeded", tc.kind, tc.endpoint)
		}
	}
	d, err := engine.NewSGLang("http://127.0.0.1:1/prefix/", nil)
	if err != nil || d.Kind() != engine.SGLang {
		t.Fatal(d, err)
	}
	wantErr(t, d.Health(context.Background()), engine.ErrUnavailable)
}

// A server that streams an endless reply is cut off at MaxResponseBytes.
func TestBoundedReply(t *testing.T) {
	t.Parallel()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		buf := make([]byte, 64<<10)
		for range 2 * engine.MaxResponseBytes / len(buf) {
			if _, err := w.Write(buf); err != nil {
				return
			}
		}
	})}
	ln, err := loopback()
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	d, err := engine.NewVLLM("http://"+ln.Addr().String(), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.Adapters(context.Background())
	wantErr(t, err, engine.ErrUnavailable)
}

func loopback() (net.Listener, error) { return net.Listen("tcp", "127.0.0.1:0") }

// A redirect is not followed: the load is not replayed elsewhere.
func TestNoRedirects(t *testing.T) {
	t.Parallel()
	target, err := loratest.NewVLLM(loratest.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, target.URL()+r.URL.Path, http.StatusTemporaryRedirect)
	})}
	ln, err := loopback()
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	for _, kind := range []engine.Kind{engine.VLLM, engine.SGLang} {
		d, err := engine.New(kind, "http://"+ln.Addr().String(), &http.Client{})
		if err != nil {
			t.Fatal(err)
		}
		wantErr(t, d.Load(context.Background(), "a", adapter(t, loratest.AdapterSpec{}), false), engine.ErrUnavailable)
	}
	if target.Loads("a") != 0 {
		t.Fatal("the redirect was followed")
	}
}

// One load and one unload against a server that answers at once.
func BenchmarkLoadUnload(b *testing.B) {
	for _, f := range flavours() {
		b.Run(f.name, func(b *testing.B) {
			srv, err := f.start(f.opts)
			if err != nil {
				b.Fatal(err)
			}
			defer srv.Close()
			d, err := engine.New(f.kind, srv.URL(), nil)
			if err != nil {
				b.Fatal(err)
			}
			dir := filepath.Join(b.TempDir(), "a")
			if err := loratest.WriteAdapter(dir, loratest.AdapterSpec{}); err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			for b.Loop() {
				if err := d.Load(ctx, "a", dir, false); err != nil {
					b.Fatal(err)
				}
				if err := d.Unload(ctx, "a"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
