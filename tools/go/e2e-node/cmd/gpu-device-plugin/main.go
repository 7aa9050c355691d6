// Command gpu-device-plugin is a kubelet device plugin (API v1beta1) for the e2e node that advertises
// nvidia.com/gpu devices with no GPU behind them, so GPU-requesting pods schedule and run on a machine without one.
//
// It serves the DevicePlugin service on a socket in the kubelet's device-plugins directory, registers it with
// the kubelet, reports -count healthy devices, and on Allocate gives the container NVIDIA_VISIBLE_DEVICES with the
// allocated IDs (nothing is mounted: there is no driver). It registers again whenever the kubelet's socket is
// recreated or its own socket removed (a kubelet restart wipes the plugin sockets) and exits on SIGINT/SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
	stop    chan struct{}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	select {
	case <-p.stop:
	case <-s.Context().Done():
	}
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIds, ",")},
		})
	}
	return resp, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func register(dir, endpoint, resource string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+filepath.Join(dir, "kubelet.sock"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: endpoint, ResourceName: resource,
	})
	return err
}

// serve runs one plugin server until the kubelet socket is replaced or a signal arrives; true means "stop".
func serve(dir, endpoint, resource string, devices []*pluginapi.Device, sigs chan os.Signal) bool {
	kubeletSock := filepath.Join(dir, "kubelet.sock")
	// the kubelet empties its device-plugins directory when it starts: listen only once its socket is there
	for {
		if _, err := os.Stat(kubeletSock); err == nil {
			break
		}
		select {
		case <-sigs:
			return true
		case <-time.After(500 * time.Millisecond):
		}
	}
	sock := filepath.Join(dir, endpoint)
	if err := os.MkdirAll(dir, 0o755); err != nil { // the kubelet may not have made it yet
		log.Fatalf("device plugin dir: %v", err)
	}
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listen %s: %v", sock, err)
	}
	p := &plugin{devices: devices, stop: make(chan struct{})}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	defer func() { close(p.stop); srv.Stop(); _ = os.Remove(sock) }()

	var registered os.FileInfo
	for {
		if registered == nil {
			if fi, err := os.Stat(kubeletSock); err == nil {
				if err := register(dir, endpoint, resource); err != nil {
					log.Printf("register with the kubelet: %v (retrying)", err)
				} else {
					registered = fi
					log.Printf("registered %s (%d devices) at %s", resource, len(devices), sock)
				}
			}
		} else if fi, err := os.Stat(kubeletSock); err != nil || !os.SameFile(fi, registered) {
			log.Printf("kubelet socket recreated: registering again")
			return false
		} else if _, err := os.Stat(sock); err != nil {
			log.Printf("plugin socket removed: serving and registering again")
			return false
		}
		select {
		case <-sigs:
			return true
		case <-time.After(time.Second):
		}
	}
}

func main() {
	dir := flag.String("device-plugin-dir", "/var/lib/kubelet/device-plugins", "the kubelet's device-plugins directory")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name to advertise")
	count := flag.Int("count", 8, "number of devices to advertise")
	endpoint := flag.String("endpoint", "naiad-e2e-gpu.sock", "socket name of this plugin inside -device-plugin-dir")
	flag.Parse()
	var devices []*pluginapi.Device
	for i := 0; i < *count; i++ {
		devices = append(devices, &pluginapi.Device{ID: fmt.Sprintf("gpu-%d", i), Health: pluginapi.Healthy})
	}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	for !serve(*dir, *endpoint, *resource, devices, sigs) {
	}
}
